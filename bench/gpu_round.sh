#!/usr/bin/env bash
# One round on a lent GPU machine (../shared/gpu/README.md), run from the project root by the device tool with
# .whl carried (bash ../shared/gpu/wheels.sh made it): the CUDA tests the open work touches, in the background
# (their compiles are CPU-bound), beside the Hub-methods bench on the 1B shape; then bench_cuda.py's continuous
# batching, padded batch and batch-1 rows alone. Every figure is printed as it comes and kept under $OUT.
set -u
OUT=${OUT:-/tmp/gpu-round}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
(
  timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda.py \
    -k "published_methods_compiled or 64_mixed or continuous_batching or compiled_step_on_the_device or waits_for_the_device_once" \
    > "$OUT/cuda_tests.log" 2>&1
  echo "cuda tests exit $?" >> "$OUT/cuda_tests.log"
) &
tests=$!
cd bench
timeout 280 python3 bench_hub_methods.py --device cuda --shape llama-1b --dtype bfloat16 --prompt-tokens 128 \
  --new-tokens 64 --runs 2 > "$OUT/hub_methods.json" 2> >(tee "$OUT/hub_methods.log" >&2)
echo "hub methods bench exit $?"
wait $tests
tail -25 "$OUT/cuda_tests.log"
timeout 250 python3 bench_cuda.py --runs 1 --shapes llama-1b --groups served batch decode 2>&1 | tee "$OUT/bench_cuda.log"
echo "bench_cuda exit ${PIPESTATUS[0]}"
# The rollback-over-a-StaticCache row needs transformers >= 5.24 (the image's 5.17 StaticCache cannot crop): where
# .whl-transformers is carried (made on the CPU machine: pip download --no-deps --python-version 3.12 ... of
# transformers==5.24.0, huggingface_hub, tokenizers, safetensors, regex, typer, hf-xet, click, shellingham at the
# versions of the CPU .venv), that row alone, last, in its own site folder.
if [ -d ../.whl-transformers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tf ../.whl-transformers/*.whl
  PYTHONPATH=/tmp/tf:$PYTHONPATH timeout 200 python3 bench_hub_methods.py --device cuda --shape llama-1b \
    --dtype bfloat16 --prompt-tokens 128 --new-tokens 64 --runs 2 --methods "rollback over a StaticCache" \
    > "$OUT/hub_rollback.json" 2> >(tee "$OUT/hub_rollback.log" >&2)
  echo "rollback row exit $?"; cat "$OUT/hub_rollback.json"
fi
