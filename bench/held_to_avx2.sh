#!/bin/sh
# Runs a command with this machine held to the paths of an AVX2-only CPU (no AVX-512, VNNI, AVX512-BF16 or AMX), to
# measure or test on an AVX-512 machine what one of those would do:
#
#     bench/held_to_avx2.sh python bench/bench_prefill.py --runs 3
#     bench/held_to_avx2.sh python -m pytest -q tests
#
# decodekit's probes are forced off (kernels/cpu.py), torch's vector kernels, oneDNN and MKL limited to AVX2; choices
# measured so are cached apart (cpu.signature reads these variables). Inductor gets a cache of its own: with one
# filled by unheld runs, compiled steps reused its AVX-512 kernels and gave wrong tokens (torch 2.13). What holding
# cannot reproduce: a real AVX2 part's clock and caches, and torch._int_mm, whose sums overflow when oneDNN is held
# below VNNI on a VNNI CPU (decodekit then does not offer int8_split; the tests that force it are skipped).
set -e
export DECODEKIT_CPU_FORCE="avx512f=0,avx512_bf16=0,avx512_vnni=0,amx_bf16=0,amx_int8=0,onednn_bf16=0,onednn_fp16=0"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor-held-to-avx2-$(id -u)}"
exec "$@"
