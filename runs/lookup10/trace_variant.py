"""agent_trace.py with the lookup prior's two long buckets replaced (measurement only)."""
import sys, runpy
sys.path.insert(0, "/work/main/scripts")
from mlx_spec import adaptive
a, b = float(sys.argv.pop(1)), float(sys.argv.pop(1))
prior = tuple(adaptive.LOOKUP_PRIOR[:5]) + ((32, a), (None, b))
d = list(adaptive.Copy.__init__.__defaults__); d[0] = prior
adaptive.Copy.__init__.__defaults__ = tuple(d)
print("prior", adaptive.Copy().prior)
sys.argv[0] = "/work/main/scripts/agent_trace.py"
runpy.run_path("/work/main/scripts/agent_trace.py", run_name="__main__")
