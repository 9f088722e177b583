# Evaluate a checkpoint of classification.py: `python examples/eval.py`.
_base_ = ["classification.py"]

eval = dict(
    checkpoint=None,  # None: work_dirs/classification/latest.pth, written by train.py
    batch_size=64,
    split="val",  # 1001 samples: not divisible by 2, 3 or 4 ranks
)
