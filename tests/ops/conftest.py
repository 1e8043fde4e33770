"""Fixtures of the ops' tests."""
import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Run the test with torch on one thread, then on two."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
