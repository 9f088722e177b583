"""The object codec: how an object travels (tensors as raw buffers, the rest pickled),
and the safe decoder for ranks that may be hostile.

- :mod:`~distkit.dist.codec.wire`: encoding and decoding objects;
- :mod:`~distkit.dist.codec.pickling`: the picklability check every world runs;
- :mod:`~distkit.dist.codec.policy`: the serializers and the safe allow-list;
- :mod:`~distkit.dist.codec.safe`, :mod:`~distkit.dist.codec.opcodes`,
  :mod:`~distkit.dist.codec.builders`: the safe decoder.
"""
