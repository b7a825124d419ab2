"""decodekit on Ray (decodekit/integrations/ray.py): a local cluster of 2 CPUs, 64 prompts through map_batches with
a full-loop method and a hook-only method, each row equal to decodekit run directly. Needs ray: `make test-ray`."""

import json

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: `make test-ray` installs it and runs these tests")

from decodekit.batch_job import BatchSettings, RowGenerator, run_batch  # noqa: E402
from decodekit.integrations.ray import BatchGenerator, on_ray  # noqa: E402

from methods import HOOK_METHOD, TRANSFORMERS_STYLE_GREEDY, write_method  # noqa: E402

WORDS = ["river", "castle", "engine", "garden", "signal", "winter", "library", "harbor"]
PROMPTS = [f"The {a} and the {b} were" for a in WORDS for b in WORDS]  # 64


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize(
    "method, extra",
    [(TRANSFORMERS_STYLE_GREEDY, {}), (HOOK_METHOD, {"banned_token": 253})],
    ids=["full-loop", "hook-only"],
)
def test_map_batches_equals_decodekit_run_directly(cluster, tmp_path, method, extra):
    repo = write_method(tmp_path / "method", method)
    settings = BatchSettings(method=str(repo), trust_remote_code=True, generation={"max_new_tokens": 4, **extra})
    dataset = ray.data.from_items([{"prompt": p} for p in PROMPTS])
    rows = dataset.map_batches(
        BatchGenerator, fn_constructor_kwargs=vars(settings), batch_size=16, concurrency=2
    ).take_all()
    assert sorted(r["prompt"] for r in rows) == sorted(PROMPTS)
    here = RowGenerator(settings)
    for row in rows:
        assert list(row["generated_token_ids"]) == here(row["prompt"])["generated_token_ids"]


def test_the_command_line_runs_on_ray_and_resumes(cluster, tmp_path):
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "id": i if i % 2 else str(i)}) + "\n" for i, p in enumerate(PROMPTS[:6]))
    )
    settings = BatchSettings(generation={"max_new_tokens": 4})
    first = [json.dumps({"prompt": PROMPTS[0], "id": "0", **RowGenerator(settings)(PROMPTS[0])}) + "\n"]
    (tmp_path / "out.jsonl").write_text(first[0])
    assert run_batch(
        tmp_path / "in.jsonl", tmp_path / "out.jsonl", settings, progress=False, runner=on_ray("local")
    ) == (5, 1)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(str(r["id"]) for r in rows) == [str(i) for i in range(6)]
    here = RowGenerator(settings)
    assert all(r["generated_token_ids"] == here(r["prompt"])["generated_token_ids"] for r in rows)
