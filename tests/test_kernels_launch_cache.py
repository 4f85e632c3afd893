"""kernels.launch_cache.CompiledLaunch with stand-in kernels (the real launch path needs CUDA; the GPU tests
run it): which path a launch takes and what the C launcher receives."""

import pytest
import triton

from kernels import launch_cache


class FakeRun:
    def __init__(self, scratch=0):
        self.calls = []
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True

    def launch(self, *args):
        self.calls.append(args)


class FakeKernel:
    def __init__(self, run):
        self.run = run
        self.function = 0xF00
        self.packed_metadata = (4, 1, 1024)
        self.runner_calls = []

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.runner_calls.append((grid, args, stream))
        return runner


@pytest.fixture
def verified(monkeypatch):
    monkeypatch.setattr(launch_cache, "_VERIFIED_LAUNCHER", (triton.__version__,))


def test_direct_launch_passes_grid_stream_and_args_in_launcher_order(verified):
    run = FakeRun()
    kernel = FakeKernel(run)
    launch_cache.CompiledLaunch(kernel)((2, 3, 1), 77, (111, 5, 1.5))
    assert run.calls == [(2, 3, 1, 77, 0xF00, False, True, None, None, (4, 1, 1024), None, None, None,
                          111, 5, 1.5)]
    assert kernel.runner_calls == []


def test_a_launch_hook_sends_launches_through_tritons_runner(verified):
    run = FakeRun()
    kernel = FakeKernel(run)
    bound = launch_cache.CompiledLaunch(kernel)
    hook = lambda meta: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        bound((1, 1, 1), 5, (9,))
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert run.calls == [] and kernel.runner_calls == [((1, 1, 1), (9,), 5)]


@pytest.mark.parametrize("scratch,version", [(64, None), (0, ("0.0.",))])
def test_scratch_memory_or_an_unverified_triton_takes_the_runner(monkeypatch, scratch, version):
    monkeypatch.setattr(launch_cache, "_VERIFIED_LAUNCHER", version or (triton.__version__,))
    run = FakeRun(scratch)
    kernel = FakeKernel(run)
    launch_cache.CompiledLaunch(kernel)((1, 1, 1), 5, (9,))
    assert run.calls == [] and len(kernel.runner_calls) == 1
