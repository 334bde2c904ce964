"""Sample text from the example GPT's weights, merged into one file by ``varuna ckpt merge``.

    varuna ckpt merge runs/demo/run/checkpoints -o runs/demo/model.safetensors
    python examples/gpt/sample.py runs/demo/model.safetensors --prompt "And God said" --tokens 300

The merged file holds every parameter under the model's own names, so the plain, unpartitioned model loads it
with ``load_state_dict(strict=True)``: no pipeline and no library are needed to use what was trained.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import CharDataset
from model import GPT, GPTConfig, generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("weights", help="a .safetensors file from `varuna ckpt merge`")
    p.add_argument("--prompt", default="In the beginning")
    p.add_argument("--tokens", type=int, default=300, help="characters to generate")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=4, help="the trained model's size (train.py's options)")
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    args = p.parse_args()

    ds = CharDataset.load()
    model = GPT(GPTConfig(vocab_size=ds.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                          n_head=args.n_head, n_embd=args.n_embd))
    model.load_state_dict(load_file(args.weights), strict=True)
    unknown = sorted(set(args.prompt) - set(ds.stoi))
    if unknown:
        raise SystemExit(f"error: the prompt uses characters the text never has: {''.join(unknown)!r}")
    prompt = torch.tensor([ds.encode(args.prompt)], dtype=torch.long)  # [1, T]
    out = generate(model, prompt, args.tokens, args.temperature, torch.Generator().manual_seed(args.seed))
    print(ds.decode(out[0]))


if __name__ == "__main__":
    main()
