"""One process acting on one CPU tier (``FLEXPAGE_CPU_TIER`` and torch's variables, set by
``test_tiers``): ``wrap`` (compiled decode steps) and an Engine in float32 and bfloat16 on
``llama-tiny``, and stock ``generate()`` beside them. Prints one JSON object: the tier acted on,
the kernels offered, and each configuration's greedy tokens; float32 stock scores every bfloat16
output teacher-forced (the share of positions where its own greedy token is the one produced)."""

import json
import sys

import torch

import flexpage
from flexpage import zoo
from flexpage.core import cpu, kernels, linear

PROMPTS = [[5 + n for n in range(12)], [40 + 3 * n for n in range(20)]]
NEW_TOKENS = 12


def agreement(exact: torch.nn.Module, prompt: list[int], tokens: list[int]) -> float:
    """The share of ``tokens`` (made after ``prompt``) that float32 ``exact`` predicts from the tokens before."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        predicted = exact(ids).logits[0, len(prompt) - 1:-1].argmax(-1)
    return (predicted == torch.tensor(tokens)).float().mean().item()


def main() -> None:
    exact = zoo.build("llama-tiny")
    report = {"tier": cpu.tier(), "march": cpu.march(), "candidates": {}, "runs": {}}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        report["candidates"][name] = [list(linear.candidates(False, dtype, bucket)) for bucket in (1, 64)]
        report["candidates"][name + "_rows_kernel"] = kernels.row_linear_available(dtype)
        stock = zoo.build("llama-tiny", dtype=dtype)
        # wrap's pool is the Engine's (16-token pages, 512 slots, 2 rows), so their steps' graphs can be shared
        wrapped = flexpage.wrap(zoo.build("llama-tiny", dtype=dtype), compile_decode=True, page_size=16,
                                max_cached_tokens=512, max_batch_size=2)
        engine = flexpage.Engine(zoo.build("llama-tiny", dtype=dtype), page_size=16, max_cached_tokens=512,
                                 max_batch_size=2, max_tokens_per_step=64)
        runs = {"stock": [], "wrap": [], "engine": engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)}
        for prompt in PROMPTS:
            for config, model in (("stock", stock), ("wrap", wrapped)):
                out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=0)
                runs[config].append(out[0, len(prompt):].tolist())
        report["runs"][name] = {config: {"tokens": outputs,
                                         "agreement": [agreement(exact, p, t) for p, t in zip(PROMPTS, outputs)]}
                                for config, outputs in runs.items()}
        report["runs"][name]["compiled_steps"] = flexpage.paged_state(wrapped).steps.steps
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
