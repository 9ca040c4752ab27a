"""Generate with a wrapped model from the zoo and check it against the stock model.

    flexpage generate                            # llama-small, 3 left-padded prompts, 32 new tokens
    flexpage generate --model qwen3-tiny --new-tokens 16
    flexpage generate --model path/to/saved/model

Prints both outputs' agreement, the paged cache's statistics and wall times.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import flexpage
from flexpage import zoo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.add_model_argument(parser)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[24, 100, 300])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=None, help="tokens per page (default: wrap's, 64 on CPU)")
    parser.add_argument("--max-cached-tokens", type=int, default=8192)
    args = parser.parse_args(argv)

    model_name = zoo.chosen_model(args)
    stock, paged = zoo.load(model_name), flexpage.wrap(zoo.load(model_name), page_size=args.page_size, max_cached_tokens=args.max_cached_tokens)
    g = torch.Generator().manual_seed(0)
    width = max(args.prompt_lengths)
    ids = torch.zeros(len(args.prompt_lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(args.prompt_lengths):  # left padding, as a tokenizer with padding_side="left" gives
        ids[i, width - n :] = torch.randint(3, stock.config.vocab_size, (n,), generator=g)
        mask[i, width - n :] = 1
    kwargs = dict(attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    outputs, seconds = {}, {}
    for name, model in (("flexpage (first call: compiles)", paged), ("stock", stock), ("flexpage", paged)):
        start = time.perf_counter()
        outputs[name] = model.generate(ids, **kwargs)
        seconds[name] = time.perf_counter() - start
    cache = flexpage.paged_state(paged).cache
    print(f"model: {model_name}  prompts: {args.prompt_lengths}  new tokens: {args.new_tokens}")
    for name, s in seconds.items():
        print(f"  {name:<34} {s:7.2f} s")
    same = torch.equal(outputs["flexpage"], outputs["stock"])
    print(f"greedy tokens identical to stock generate(): {same}")
    print(f"paged cache: {cache.page_table.num_pages} pages of {cache.page_size} tokens, "
          f"{len(cache.layers)} layers, {cache.dtype}; after the call: {cache.stats()}")
    print("first row's new tokens:", outputs["flexpage"][0, width:].tolist())
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
