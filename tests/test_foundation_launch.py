"""The strategy under real torchrun. (Gradient accumulation under dp=2: the layout table, tests/test_layouts.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_collectives_predict_validate(tmp_path):
    out = tmp_path / "result"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests._torchrun_collectives", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert r0["env"] == "TorchElasticEnvironment" and r0["launched_externally"]
    assert r0["world"] == 2 and r0["gathered"] == [0.0, 1.0] == r1["gathered"]
    assert r0["summed"] == 3.0 == r1["summed"] and r0["mean"] == 1.5 == r1["mean"]
    assert r1["from_zero"] == {"rank": 0}
    assert r0["sampler"] == {"num_replicas": 2, "rank": 0} and r1["sampler"] == {"num_replicas": 2, "rank": 1}
    assert r0["pred_batches"] == 2 and r0["pred_shape"] == [4, 32]
    assert r0["val_loss"] == r1["val_loss"]  # sync_dist=True makes the logged value global

