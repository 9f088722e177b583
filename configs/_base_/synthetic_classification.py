# A small classification task on deterministic synthetic data (no downloads): inputs are
# Gaussian, labels come from a fixed random linear "teacher" plus noise. The same seeds
# give the same samples on every machine and every number of ranks.
data = dict(
    num_features=32,
    num_classes=4,
    noise=0.5,
    teacher_seed=7,
    # 1200 divides by 1, 2, 3, 4 and by the global batch size: every world size sees the
    # same global batches
    train=dict(num_samples=1200, seed=0),
    # 1001 = 7 * 11 * 13 divides by none of 2, 3, 4: samplers must pad, and collection
    # must drop the padding
    val=dict(num_samples=1001, seed=1),
)
