"""A verifiers 0.4 taskset with a tool, for tests/test_verifiers_v04.py: the model calls `calc_add` (an MCP tool
server, tools.py) and answers with its result; multi-turn through the `null` harness's chat program. The tool
server is the taskset's (verifiers' shared scope: started once when the environment starts serving, held by the
bridge's `env.serving()`, and reached by every rollout), not each task's: a task-scoped server is a Python
importing verifiers per rollout (~4-8 s each on a 2-core machine), the test's largest cost. Imported in
.venv-verifiers only, never by rlflow."""

import verifiers.v1 as vf

from vf04_calc.tools import CalcToolset


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    def load(self) -> list[CalcTask]:
        return [CalcTask(CalcData(prompt=f"Add {a} and {b} with the tool.", answer=str(a + b)), self.config.task)
                for a, b in [(12, 30), (7, 8)]]


__all__ = ["CalcTaskset"]
