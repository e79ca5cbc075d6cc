"""Made tests/data/torch_fr/: real flight-recorder dumps of torch 2.13 from two gloo ranks (pickle and JSON).

Run as `python make_dumps.py 0 & python make_dumps.py 1` in an empty folder; gloo records into torch's
flight recorder too, so the schema is the one ProcessGroupNCCL dumps on a watchdog timeout. The DTensor
full_tensor() and clip_grad_norm_ calls show functional collectives with their Python frames.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

rank = int(sys.argv[1])
os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
dist.init_process_group("gloo", store=dist.FileStore("./store", 2), rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
dist.all_reduce(torch.ones(4, 3))
w = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
full = w.full_tensor()
p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
p.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
torch.nn.utils.clip_grad_norm_([p], 1.0)
c = torch._C._distributed_c10d
open(f"./torch_fr_trace_rank{rank}", "wb").write(c._dump_fr_trace(True, True, False))
open(f"./torch_fr_trace_json_rank{rank}", "wb").write(c._dump_fr_trace_json(True, False))
dist.barrier()
dist.destroy_process_group()
