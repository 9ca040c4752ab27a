"""Run by tests/test_tensor_parallel.py under torchrun (2 CPU processes, gloo): wrap and the Engine
on a model loaded with transformers' tensor parallelism. Each rank writes what it saw as JSON."""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import flexpage

model_dir, out_dir = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a divergence fails instead of hanging
rank = dist.get_rank()
torch.set_num_threads(1)


def load():
    return AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_size=2)).eval()


result = {}
# wrap: every rank generates the same inputs, as transformers' TP requires
ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[1, :9] = 0
model = load()
stock = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
flexpage.wrap(model, max_cached_tokens=1024)
result["pool_shape"] = list(flexpage.paged_state(model).cache.layers[0].keys.shape)
result["wrap"] = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0).tolist()
result["wrap_stock_tp"] = stock.tolist()

# the Engine: requests enter on rank 0; a small pool forces preemption, a shared prefix hits the cache
g = torch.Generator().manual_seed(1)
shared = torch.randint(3, 256, (48,), generator=g).tolist()
prompts = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 40, 90, 17, 60, 3)]
engine = flexpage.Engine(load(), page_size=16, max_cached_tokens=256, max_batch_size=4, max_tokens_per_step=64,
                         check_ranks=True)
if rank == 0:
    greedy = engine.generate(prompts, max_new_tokens=[30, 12, 25, 40, 8, 20])
    seeded = engine.generate(prompts[:2], max_new_tokens=12, do_sample=True, top_k=20, seed=7, num_return_sequences=2)
    unseeded = engine.generate(prompts[2:3], max_new_tokens=12, do_sample=True)  # rank 0 picks the seed
    engine.close()
    outputs = greedy + seeded + unseeded
else:
    followed = engine.follow()
    outputs = [followed[i] for i in sorted(followed)]
stats = engine.stats()
result.update(engine=outputs, preemptions=stats.preemptions, prefix_hit_tokens=stats.prefix_hit_tokens,
              pages_used_after=engine.cache.stats().pages_used, prompts=prompts)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
