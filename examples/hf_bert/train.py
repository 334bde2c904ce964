"""Train a Hugging Face BERT (masked language model) with pipeline and data parallelism and automatic cut points.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 examples/hf_bert/train.py --stage-to-rank-map "0,2;1,3"
    varuna launch plan.yaml -- examples/hf_bert/train.py --steps 200     # plan from examples/hf_bert/spec.py:spec

``python examples/hf_bert/train.py`` trains as one process. ``--help`` lists the options.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import model  # noqa: E402
from hf_common import main  # noqa: E402

if __name__ == "__main__":
    main(model)
