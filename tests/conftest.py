"""The one spawn helper: a pool of real gloo ranks per world size, kept for the whole session.

Test bodies are module-level functions (picklable) that run on every rank; ``ranks(n).run(fn, ...)``
returns their per-rank results or raises ``RankError`` with the failing rank's traceback. A pool
that had to be stopped (a rank stuck or dead) is replaced by a fresh one for the next test.

The pools check every collective across ranks (``launch/checking.py``): a test whose ranks feed
a collective different shapes fails with one line naming them instead of gloo aborting the pool.
The collective counts are the same (the check runs below the dispatcher that counts them). The
check costs about 3 ms per collective, a quarter to a third more time for tests that run many
steps, but the whole suite took 540 s checked against 550 s with only tests/core checked
(two fresh clones on the same machine). ``TENSORPAR_CHECK_COLLECTIVES=0`` (or false, no,
off) runs every pool unchecked, ``=1`` (true, yes, on) every pool checked, ``=core`` only the layer
tests' (tests/core). Commands the tests start, as processes or in this one, run as a user's
would: unchecked, unless the test asks for the check (the variable is not passed on to them).
"""

import gc
import signal

import pytest

from tensorpar.ranks.forkserver import COMMAND_MODULES, COMPILE_MODULES, HF_MODULES, start_server
from tensorpar.ranks.local import RankPool

from tests_common import WORLD_SIZES, groups_held, pools_checked  # noqa: F401

# A suite started in the background of a non-interactive shell (`make test &`) inherits SIGINT
# ignored, and every command it starts would too (an ignored signal stays ignored through exec):
# the Ctrl-C tests' SIGINT would then reach no one. Ctrl-C as a terminal gives it, for all.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every rank this session forks, the pools' and those of commands run in this process
# (tests_common.tensorpar_here), comes from one fork server that imports, once, what the
# commands' ranks import (torch._dynamo and matplotlib: 3 s a rank otherwise; transformers' model
# code for --hf: 4 s; torch.compile's AOT autograd for --compile: 1 s). With transformers in
# every rank a MemoryMeter's scan of the live objects at entry takes 0.42 s instead of 0.33.
start_server(sorted({module for modules in COMMAND_MODULES.values() for module in modules}
                    | set(HF_MODULES) | set(COMPILE_MODULES)))


# The fast tier (``make test-fast``: ``-m "not slow"``) is every package's core behaviour, under
# 3 minutes on 2 cores. These are left to the full suite (``make test``, CI): the end-to-end runs
# (whole commands, torchrun, signals, compile, the README's and the docs' programs) and more
# sizes of what the fast tier checks at one or two. A node id (or its start) a line.
SLOW = (
    # end to end: whole commands, torchrun, processes, compiled graphs, the benchmark
    *(f"tests/train/test_stop_resume.py::test_{name}" for name in (  # the signal's agreement
        "preemption", "ctrl_c", "second_signal", "resume_edge", "resume_keeps")),  # stays
    "tests/train/test_train_cli.py",
    "tests/train/test_failures.py", "tests/train/test_lost_rank.py",
    "tests/train/test_torchrun_train.py", "tests/train/test_nonfinite.py",
    "tests/train/test_compile_train.py", "tests/train/test_tensorboard.py",
    "tests/train/test_wandb.py", "tests/train/test_shards_cli.py",
    "tests/train/test_checked_runs.py", "tests/hf/test_lora_train.py",
    "tests/gpt/test_compile_model.py", "tests/train/test_moe_resume.py",
    "tests/hf/test_hf_export_moe.py::test_shared_experts_export_as_qwen2_moe",
    "tests/hf/test_hf_train.py", "tests/hf/test_hf_train_cli.py", "tests/hf/test_hf_generate.py",
    "tests/hf/test_hf_dropout.py", "tests/hf/test_hf_export.py", "tests/dp/test_multinode.py",
    "tests/core/test_torchrun_crash.py", "tests/bench/", "tests/planner/test_meter_profiled.py",
    "tests/planner/test_plan_modes.py", "tests/test_docs.py::test_python_block",
    "tests/test_cli.py::test_verify_under_torchrun",
    "tests/hf/test_hf.py::test_cli_generate_under_torchrun",
    "tests/core/test_check_collectives.py::test_lost_rank_under_torchrun",
    "tests/core/test_fused.py::test_compiled_",
    "tests/core/test_launch.py::test_ranks_start_again_when_their_port_was_taken",
    # more sizes and modes of what the fast tier checks at one or two
    "tests/gpt/test_generate.py::test_tokens_equal_across_tp",
    "tests/train/test_train.py::test_resume_repeats_uninterrupted_run[2-2-False-0.1]",
    "tests/train/test_train.py::test_resume_repeats_uninterrupted_run[2-4-False-0.0]",
    "tests/train/test_train.py::test_loss_curve_equal_across_tp[3-True]",
    "tests/train/test_train.py::test_loss_curve_equal_across_tp[4-False]",
    "tests/train/test_accumulation.py::test_accumulated_step_equals_one_pass[tp2-recompute]",
    "tests/train/test_accumulation.py::test_accumulated_step_equals_one_pass[tp2-sp]",
    "tests/train/test_accumulation.py::test_accumulated_step_equals_one_pass[tp4]",
    "tests/train/test_shards.py::test_training_on_shards",
    "tests/hf/test_chat.py::test_first_step_loss", "tests/hf/test_chat.py::test_packed",
    "tests/hf/test_labels_loss.py::test_labels_loss_is_the_dense_models_without_gathering[40]",
    "tests/hf/test_lora.py::test_lora_matches_peft_at_every_tp_size[3-",
    "tests/train/test_accumulation.py::test_accumulated_step_equals_one_pass[tp2-dp2-",
    "tests/train/test_accumulation.py::test_ignored_targets_mean_over_the_steps_tokens[4-",
    "tests/train/test_validation.py::test_validation_loss_equal_across_tp_and_dp[tp2-dp2-fsdp]",
    "tests/planner/test_plan.py::test_predictions_match_measurements[3]",
    "tests/planner/test_plan.py::test_predictions_match_measurements[4]",
    "tests/planner/test_plan_dp.py::test_dp_predictions_match_measurements[2-2]",
    "tests/dp/test_train_dp.py::test_loss_curve_equals_one_device[4-1-fsdp]",
    "tests/dp/test_train_dp.py::test_loss_curve_equals_one_device[1-4-fsdp]",
    "tests/dp/test_train_dp.py::test_loss_curve_equals_one_device[2-2-ddp]",
    "tests/dp/test_train_dp.py::test_resume_at_another_split[saved2",
    "tests/dp/test_train_dp.py::test_bf16_curves_follow_fp32",
    "tests/gpt/test_randomness.py::test_recompute_replays_dropout_masks[2-",
    "tests/core/test_fused.py::test_fused_column_skips_what_needs_no_gradient[True-True-3]",
    "tests/core/test_fused.py::test_fused_column_skips_what_needs_no_gradient[False-True-3]",
    "tests/core/test_properties_blocks.py::test_gpt",
    "tests/core/test_properties_blocks.py::test_parallel_block",
    "tests/hf/test_hf.py::test_from_pretrained_matches_dense[4-",
    "tests/hf/test_hf.py::test_from_pretrained_matches_dense[1-",
    "tests/dp/test_train_dp.py::test_resume_at_another_split",
    "tests/test_cli.py::test_verify_passes[flags0]",
    "tests/test_cuda.py::test_device_cuda_without_a_gpu_is_one_line",
    "tests/gpt/test_generate.py::test_cli_several_prompts",
    "tests/core/test_properties_blocks.py::test_parallel_mlp",
    "tests/core/test_fused.py::test_fused_column_skips_what_needs_no_gradient[False-True-1]",
    "tests/gpt/test_randomness.py::test_a_run_saved_under_the_sequential_dropout_scheme",
    *(f"tests/hf/test_hf_verify.py::test_verify_hf_every_family[{family}]" for family in (
        "mistral", "qwen2-tied", "qwen3", "gemma2", "granite", "starcoder2", "cohere",
        "smollm3")),  # the Llama family's others; gpt2, llama, gemma and gpt_neox stay
    "tests/planner/test_plan.py::test_predictions_match_measurements[2]",
    "tests/hf/test_hf_reference.py::test_full_fine_tune",  # LoRA's at TP 1 and 2 stay
    "tests/planner/test_search.py::test_search_lists_exactly_the_layouts_that_fit_ranked_by_its"
    "_step_time[70b-",  # llama-2-7b's two stay
    "tests/core/test_moe.py::test_layouts_equal_one_process[tp2-is-ep2]",
    "tests/core/test_moe.py::test_routers_equal_one_process[tp2-ep2-",
    "tests/core/test_moe.py::test_sequence_parallel[tp2-ep2]",
)


def pytest_collection_modifyitems(config, items):
    """Mark the tests of ``SLOW`` slow (the fast tier leaves them out)."""
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    """Exit promptly after the summary: pytest then runs five full garbage collections (its
    check for exceptions raised in ``__del__``) and the interpreter one more at exit, each a walk
    of every object the session still holds (torch, transformers, dynamo: over a million
    objects; 50-86 s in all after a whole suite on a loaded machine). One collection here still
    frees the session's cyclic garbage, so pytest's check still sees what it would raise; the
    survivors are then exempt from the later walks (``gc.freeze``). Nothing else waits: the
    pools' ranks were stopped before the summary (``_pools``), and the fork server ends with
    this process (``ranks/forkserver.py``)."""
    gc.collect()
    gc.freeze()


class Pools:
    """The session's pools of ranks, one per (world size, checked), started when first asked for
    and replaced when closed (a rank failed). A rank keeps every process group a run made in it
    (a data-parallel mesh makes one or two; destroying them at a run's end broke the next run,
    whose DeviceMesh resolves groups by name), and gloo's event-loop threads of each keep
    polling, idle or not: late in a whole suite a 4-rank pool's ranks held 130 to 200 groups
    (400 to 600 threads) each and used a tenth of a core each while idle, and the suite took 30
    minutes instead of 16. So at each test module's start a pool whose ranks hold more than
    ``GROUPS_KEPT`` groups is replaced by a fresh one (a tenth of a second; ten times in the
    whole suite)."""

    GROUPS_KEPT = 16

    def __init__(self):
        self.pools: dict[tuple[int, bool], RankPool] = {}

    def __call__(self, n: int, checked: bool) -> RankPool:
        if (n, checked) not in self.pools or self.pools[n, checked]._closed:
            self.pools[n, checked] = RankPool(n, backend="gloo", threads=1, timeout_s=240,
                                              grace_s=5, check_collectives=checked)
        return self.pools[n, checked]

    def renew_crowded(self) -> None:
        crowded = [key for key, pool in self.pools.items()
                   if not pool._closed and max(pool.run(groups_held)) > self.GROUPS_KEPT]
        self.close(crowded)

    def close(self, keys) -> None:
        """Stop the pools of ``keys`` side by side (each rank leaves its process groups first)."""
        for key in keys:
            self.pools[key].ask_to_stop()
        for key in keys:
            self.pools.pop(key).close()


@pytest.fixture(scope="session")
def _pools():
    pools = Pools()
    yield pools
    pools.close(list(pools.pools))


@pytest.fixture(scope="module")
def ranks(_pools, request):
    """``ranks(n)``: the session's pool of n ranks. The layer tests' pools (tests/core) check
    every collective (shapes and dtypes compared across the ranks first); the others compare
    their results with references and run unchecked, a fifth faster
    (``tests_common.pools_checked``: TENSORPAR_CHECK_COLLECTIVES on, as the CLI reads it: every
    pool checks; off: none; unset or "core": as said)."""
    checked = pools_checked(request.node.path.parent.name)
    _pools.renew_crowded()
    return lambda n: _pools(n, checked)
