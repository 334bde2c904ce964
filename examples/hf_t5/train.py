"""Train a Hugging Face T5 (encoder–decoder, denoising) with pipeline and data parallelism and automatic cut points.

    varuna profile examples/hf_t5/spec.py:spec -o t5.json              # reports what skips over each cut
    varuna plan t5.json --gpus 4 --batch-size 16 -o plan.yaml
    varuna launch plan.yaml -- examples/hf_t5/train.py --steps 200
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/hf_t5/train.py --stage-to-rank-map "0;1;2;3"

``python examples/hf_t5/train.py`` trains as one process. ``--help`` lists the options.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import model  # noqa: E402
from hf_common import main  # noqa: E402

if __name__ == "__main__":
    main(model)
