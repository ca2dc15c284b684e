"""The public surface: ``__all__`` lists every public name and nothing private leaks."""

import types

import opsched
import opsched.aclnn


def test_all_lists_exactly_the_public_names():
    public = {
        name
        for name, value in vars(opsched).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    public |= {"aclnn", "sync", "__version__"}
    assert set(opsched.__all__) == public
    for name in opsched.__all__:
        assert hasattr(opsched, name), name


def test_public_objects_claim_the_public_module():
    for name in opsched.__all__:
        value = getattr(opsched, name)
        if isinstance(value, type):
            assert not value.__name__.startswith("_"), name


def test_aclnn_all():
    for name in opsched.aclnn.__all__:
        assert hasattr(opsched.aclnn, name)
    assert {
        "glu_backward",
        "glu_backward_get_workspace_size",
        "group_norm_grad",
        "group_norm_grad_get_workspace_size",
    } <= set(opsched.aclnn.__all__)
