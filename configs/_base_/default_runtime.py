# Settings every run shares: the seed (model initialisation and data order) and where
# outputs go (None: work_dirs/<config name>).
seed = 2026
work_dir = None
