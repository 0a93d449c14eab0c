"""A verifiers 0.4 taskset with a tool, for tests/test_verifiers_v04.py: the model calls `calc_add` (an MCP tool
server verifiers starts per rollout, tools.py) and answers with its result; multi-turn through the `null` harness's
chat program. Imported in .venv-verifiers only, never by rlflow."""

import verifiers.v1 as vf

from vf04_calc.tools import CalcToolset


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> list[CalcTask]:
        return [CalcTask(CalcData(prompt=f"Add {a} and {b} with the tool.", answer=str(a + b)), self.config.task)
                for a, b in [(12, 30), (7, 8)]]


__all__ = ["CalcTaskset"]
