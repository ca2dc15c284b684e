"""The scheduler core: lifecycle, admission, requests, checks, batching, graph runs,
statistics, the loop adapter, config and traces.

It knows devices only through :mod:`opsched.devices`' interface and operators only through
their descriptions: it never imports torch, the kernels, a specific device or operator
module, or the CLI, and never names an operator (a test holds it to that).
"""
