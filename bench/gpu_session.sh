#!/usr/bin/env bash
# One lent-GPU session's checks, in one call (the device time is short: a start costs minutes).
#
#   bash bench/gpu_session.sh [OUT_DIR]
#
# Runs bench/gpu_check.py twice: at batch 4,096 with --profile (AMP fp16 + GradScaler, bf16, fp32, the fused
# row-wise Adagrad against the unfused step and against the floor, torch.export, the onnx/TensorRT serving
# check, pinned copies) and at batch 32,768 (the same training checks, fewer steps, no serving check). Writes
# gpu_<batch>.json (the one JSON line) and gpu_<batch>.log (progress) into OUT_DIR (default: $OUT, else
# .streamrec/gpu), and prints a short table last. Python packages the machine lacks (orjson) are installed
# first from wheels in .whl/ when that folder exists (see bench/README.md, "GPU").
set -u
out=${1:-${OUT:-.streamrec/gpu}}
mkdir -p "$out"
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
$py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tee -a "$out/gpu.txt"
export PYTHONUNBUFFERED=1
rc=0
timeout "${GPU_CHECK_TIMEOUT_S:-300}" $py bench/gpu_check.py --profile >"$out/gpu_4096.json" 2>"$out/gpu_4096.log" || rc=$?
timeout "${GPU_CHECK_TIMEOUT_S:-200}" $py bench/gpu_check.py --batch 32768 --batches 24 --steps 60 \
    --skip tensorrt,export,sparse_grad,fp16_overflow >"$out/gpu_32768.json" 2>"$out/gpu_32768.log" || rc=$?
timeout "${GPU_PROFILE_TIMEOUT_S:-150}" $py bench/gpu_profile.py >"$out/gpu_profile.json" 2>"$out/gpu_profile.log" || rc=$?
$py - "$out" <<'EOF'
import json, sys
from pathlib import Path
for b in ("4096", "32768"):
    p = Path(sys.argv[1]) / f"gpu_{b}.json"
    try:
        s = json.loads(p.read_text().strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001
        print(f"batch {b}: no result ({exc}); see gpu_{b}.log")
        continue
    c = s.get("checks", {})
    row = {k: v.get("ex_per_s") for k, v in c.items() if "ex_per_s" in v}
    print(f"batch {b}: ex/s {row}")
    print(f"  ratios {s.get('ratios')} failed {s.get('failed')} wall {s.get('wall_s')} s")
try:
    prof = json.loads((Path(sys.argv[1]) / "gpu_profile.json").read_text())
    for k, v in prof.items():
        if isinstance(v, dict):
            print(f"profile {k}: wall {v['wall_ms']} ms, kernels {v['kernel_ms_per_step']} ms per step")
except Exception as exc:  # noqa: BLE001
    print(f"profile: no result ({exc}); see gpu_profile.log")
EOF
exit $rc
