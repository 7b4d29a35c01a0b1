"""A swarm whose nodes compute in different precisions trains: one stage node in bfloat16 (autocast, float32
master weights), the others in float32, activations travelling in the run's float32."""

from __future__ import annotations

from statistics import mean

import pytest
from swarm_harness import LocalTestSwarm, step_losses

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_a_bfloat16_node_trains_in_a_float32_swarm(swarm: LocalTestSwarm) -> None:
    swarm.bootstrap(steps=24)
    stages = [
        swarm.join(1, "--device", "cpu"),
        swarm.join(2, "--device", "cpu", "--dtype", "bfloat16"),
        swarm.join(3, "--device", "cpu"),
    ]
    online = swarm.wait_online(*stages)
    assert [(e["device"], e["dtype"]) for e in online] == [
        ("cpu", "float32"),
        ("cpu", "bfloat16"),
        ("cpu", "float32"),
    ]
    data = swarm.join(0, "--device", "cpu")
    finished = data.wait_event("finished", 180)
    assert data.wait_exit(30) == 0
    losses = step_losses(data.events())
    assert len(losses) == finished["step"] == 24
    assert mean(losses[-4:]) < mean(losses[:4]) - 0.5, losses
    assert finished["microbatches_lost"] == 0
    validations = [e["val_loss"] for e in data.events("validation")]
    assert validations and validations[-1] < validations[0] - 0.5, validations
