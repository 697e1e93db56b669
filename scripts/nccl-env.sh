#!/usr/bin/env bash
# Prints export lines for the NCCL that ships inside a Python environment (the nvidia-nccl package),
# which is not on the loader's path:
#   eval "$(scripts/nccl-env.sh)"     # sets CUVMM_NCCL_LIBRARY and CUVMM_NCCL_INCLUDE
# Prints nothing and exits 1 when no such package is found. PYTHON picks the interpreter.
set -euo pipefail
"${PYTHON:-python3}" - <<'PY'
import os, sys
try:
    import nvidia
except ImportError:
    sys.exit(1)
lib = inc = None
for root in list(nvidia.__path__):
    for d, _, files in os.walk(root):
        if lib is None and "libnccl.so.2" in files:
            lib = os.path.join(d, "libnccl.so.2")
        if inc is None and "nccl.h" in files:
            inc = d
if lib is None:
    sys.exit(1)
print(f"export CUVMM_NCCL_LIBRARY={lib}")
if inc is not None:
    print(f"export CUVMM_NCCL_INCLUDE={inc}")
PY
