import torch

import distkit.dist as dist

dist.init_dist()  # reads torchrun's variables; without a launcher: a world of one rank
rank, world = dist.get_dist_info()
shards = dist.all_gather(torch.arange(rank + 1.0))  # shapes may differ between ranks
loss = dist.all_reduce(torch.tensor(float(rank)), op="mean")  # in place, and returned
stats = dist.gather_object({"rank": rank, "sizes": [len(s) for s in shards]})
if dist.is_main_process():
    print(f"world={world} mean loss={loss.item():.2f} stats={stats}")
dist.destroy_dist()
