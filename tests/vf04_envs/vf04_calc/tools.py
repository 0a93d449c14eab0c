"""The tool server of vf04_calc (run by verifiers as `python -m vf04_calc.tools` in the rollout's runtime)."""

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


if __name__ == "__main__":
    CalcToolset.run()
