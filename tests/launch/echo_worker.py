"""A worker that only reports what the launcher gave it: its arguments and its environment (then exits 0)."""

import json
import os
import sys

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VARUNA_PLAN",
        "VARUNA_CKPT_DIR", "VARUNA_RESUME_STEP", "GLOO_SOCKET_IFNAME", "FROM_ENV_FILE", "SPACED",
        "PYTHONFAULTHANDLER")
print("ECHO " + json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in KEYS},
                            "plan_exists": os.path.isfile(os.environ.get("VARUNA_PLAN", ""))}), flush=True)
