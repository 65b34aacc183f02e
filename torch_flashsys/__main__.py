"""``python -m torch_flashsys``: print an environment report to paste into bug reports."""

from torch_flashsys._env import report

if __name__ == "__main__":
    print(report())
