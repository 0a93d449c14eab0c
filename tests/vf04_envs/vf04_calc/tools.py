"""The tool server of vf04_calc (run by verifiers as `python -m vf04_calc.tools`, once per environment)."""

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


if __name__ == "__main__":
    CalcToolset.run()
