"""The backends: one object per kind of world, one method per collective.

- :mod:`~distkit.dist.backends.base`: the contract (:class:`Backend`);
- :mod:`~distkit.dist.backends.single`: no process group, a world of one rank;
- :mod:`~distkit.dist.backends.tensors` and :mod:`~distkit.dist.backends.objects`: a
  torch.distributed process group (tensor and object collectives), with
  :mod:`~distkit.dist.backends.gloo` for the dtypes gloo cannot carry (the plainest
  ``all_reduce`` takes the torch backend's lean lane, :attr:`TorchBackend.lane`);
- :mod:`~distkit.dist.backends.uneven` and :mod:`~distkit.dist.backends.stream`: the
  protocols of uneven collectives and of ``iter_results``;
- :mod:`~distkit.dist.backends.traced`: the same group while ``torch.compile`` traces.

:mod:`distkit.dist._route` picks one for each call.
"""
