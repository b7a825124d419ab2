#!/usr/bin/env bash
# One round on a lent GPU machine (../shared/gpu/README.md), run from the project root by the device tool with
# .whl carried (bash ../shared/gpu/wheels.sh made it), in one call of at most 600 s: the CUDA tests of continuous
# batching, flex attention and the compiled loops' synchronisations first (so that they do not share the GPU with
# timings); then bench_cuda.py's continuous batching (gathered and flex attention), padded batch, batch-1 rows and the
# batch-1 profile alone; then, with what time is left, the Hub rollback-over-a-StaticCache row. The published-methods
# matrix (tests/test_cuda.py -k published_methods_compiled) is left to `make test-cuda`. Every figure is printed as it comes and kept under
# $OUT: a call stopped at its limit keeps them.
set -u
OUT=${OUT:-/tmp/gpu-round}
LIMIT=${LIMIT:-580}  # seconds this script may take in all (the device tool stops a call at 600)
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  -k "64_mixed or continuous_batching or waits_for_the_device or flex" \
  2>&1 | tee "$OUT/cuda_tests.log" | tail -25
echo "cuda tests exit ${PIPESTATUS[0]} at ${SECONDS} s"
cd bench
timeout $((LIMIT - SECONDS - 60)) python3 bench_cuda.py --runs 1 --shapes llama-1b --groups served batch decode profile \
  2>&1 | tee "$OUT/bench_cuda.log"
echo "bench_cuda exit ${PIPESTATUS[0]} at ${SECONDS} s"
# The rollback-over-a-StaticCache row needs transformers >= 5.24 (the image's 5.17 StaticCache cannot crop): where
# .whl-transformers is carried (made on the CPU machine: pip download --no-deps --python-version 3.12 ... of
# transformers==5.24.0, huggingface_hub, tokenizers, safetensors, regex, typer, hf-xet, click, shellingham at the
# versions of the CPU .venv), that row alone, last, in its own site folder, in the time left.
left=$((LIMIT - SECONDS))
if [ -d ../.whl-transformers ] && [ "$left" -gt 60 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tf ../.whl-transformers/*.whl
  PYTHONPATH=/tmp/tf:$PYTHONPATH timeout $((LIMIT - SECONDS)) python3 bench_hub_methods.py --device cuda \
    --shape llama-1b --dtype bfloat16 --prompt-tokens 128 --new-tokens 64 --runs 2 \
    --methods "rollback over a StaticCache" > "$OUT/hub_rollback.json" 2> >(tee "$OUT/hub_rollback.log" >&2)
  echo "rollback row exit $?"; cat "$OUT/hub_rollback.json"
fi
