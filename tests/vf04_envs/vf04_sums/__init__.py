"""A verifiers 0.4 taskset for tests/test_verifiers_v04.py, written as verifiers' `vf-init` scaffolds one: sums of
two numbers, answered in one reply, scored by a @vf.reward. Imported in .venv-verifiers only (the bridge's
PYTHONPATH), never by rlflow."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 3


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [SumTask(SumData(prompt=f"{i}+{i}=", answer=str(2 * i)), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["SumTaskset"]
