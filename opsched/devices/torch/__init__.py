"""The torch devices (``torch:cpu``, ``torch:cuda[:N]``, ``torch:npu[:N]``): one folder.

- :mod:`.device`: :class:`~opsched.devices.torch.device.TorchDevice`, its streams, binding,
  launches and memory;
- :mod:`.launchers`: each operator's framework calls, one module per operator
  (:mod:`.glu_backward`, :mod:`.group_norm_grad`, :mod:`.group_norm_backward`);
- :mod:`.layout`: the batch-invariant layout rules every launcher follows;
- :mod:`.aten`: the framework's operators called once per request (the benchmarks' peer),
  and tensor conversions; importable without torch.

Importing this package imports nothing of torch; its modules but :mod:`.aten` do.
"""
