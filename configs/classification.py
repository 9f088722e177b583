# Train a small MLP on the synthetic task: `python examples/train.py` uses this config.
# Override anything from the command line: --cfg-options train.epochs=3 train.lr=0.05
_base_ = [
    "_base_/dist_cfg.py",
    "_base_/synthetic_classification.py",
    "_base_/default_runtime.py",
]

model = dict(hidden=64, depth=2)  # no BatchNorm, no dropout: results do not depend on ranks
train = dict(
    epochs=6,
    global_batch_size=48,  # split evenly over the ranks
    lr=0.05,
    momentum=0.9,
    weight_decay=1e-4,
    step_delay=0.0,  # seconds to sleep per step (tests use it to stop a run mid-epoch)
    # a straggler, to see one in a profile (distkit launch --profile trace.json ...):
    # rank slow_rank sleeps slow_seconds before each of its validation batches
    slow_rank=None,
    slow_seconds=0.0,
)
