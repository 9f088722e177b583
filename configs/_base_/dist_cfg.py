# Process-group settings shared by every config: passed to distkit.dist.init_dist.
# backend=None picks nccl where every local rank has a GPU, else gloo.
dist_cfg = dict(launcher="auto", backend=None, timeout=1800)
