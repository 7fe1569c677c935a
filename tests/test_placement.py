"""The placement check over `ray.nodes()`-shaped data: where bundles go, and the one-line shortfall (no Ray)."""
from __future__ import annotations

import pytest

from app.config.load import load_config
from app.run.placement import PlacementError, check_placement
from app.run.topology import plan_bundles


def _node(ip: str, cpus: float, gpus: float, alive: bool = True, node_id: str = "") -> dict:
    res = {"CPU": cpus, "memory": 1e9, f"node:{ip}": 1.0}
    if gpus:
        res["GPU"] = gpus
    return {"NodeID": node_id or ip.replace(".", "") * 4, "Alive": alive, "NodeManagerAddress": ip, "Resources": res}


def _bundles(nt=5, nd=3, gpu=1.0, cpu_t=2.0, cpu_d=4.0):
    return [{"CPU": cpu_t, "GPU": gpu}] * nt + [{"CPU": cpu_d, "GPU": gpu}] * nd


def test_one_8_gpu_node_fits_5_3_with_pack() -> None:
    fit = check_placement(_bundles(), 5, 3, [_node("10.0.0.1", 64, 8)], "PACK")
    assert fit.nodes == ["10.0.0.1"] * 8


def test_pack_fills_one_node_first_and_spread_uses_every_node() -> None:
    nodes = [_node("10.0.0.1", 32, 4), _node("10.0.0.2", 32, 4), _node("10.0.0.3", 32, 4)]
    packed = check_placement(_bundles(2, 2), 2, 2, nodes, "PACK")
    spread = check_placement(_bundles(2, 2), 2, 2, nodes, "SPREAD")
    assert packed.spread() == 1
    assert spread.spread() == 3 and sorted(spread.nodes).count("10.0.0.1") <= 2


def test_too_few_gpus_names_the_bundle_each_node_and_the_fix() -> None:
    nodes = [_node("10.0.0.1", 64, 4), _node("10.0.0.2", 64, 2)]
    with pytest.raises(PlacementError) as err:
        check_placement(_bundles(), 5, 3, nodes, "PACK")
    msg = str(err.value)
    assert "\n" not in msg
    assert "(the topology needs 8 GPU, the cluster has 6)" in msg
    assert "10.0.0.1 has 0 of 4 GPU left" in msg and "10.0.0.2 has 0 of 2 GPU left" in msg
    assert "topology.num_" in msg and "add a node with" in msg


def test_enough_gpus_in_total_but_cpus_short_on_the_gpu_node() -> None:
    # 8 GPUs, but node 2 has CPUs for only 3 of the 4 targets that must go there.
    nodes = [_node("10.0.0.1", 64, 4), _node("10.0.0.2", 3, 4)]
    with pytest.raises(PlacementError) as err:
        check_placement(_bundles(nt=5, nd=3, cpu_t=1, cpu_d=4), 5, 3, nodes, "PACK")
    msg = str(err.value)
    assert "target 4 bundle {GPU: 1, CPU: 1} fits on no node" in msg
    assert "10.0.0.1 has 0 of 4 GPU left; 10.0.0.2 has 0 of 3 CPU left" in msg
    assert "needs" not in msg  # GPUs suffice in total: the line does not blame them
    assert "topology.cpus_per_target" in msg


def test_a_bundle_bigger_than_any_node() -> None:
    with pytest.raises(PlacementError, match=r"drafter 0 bundle \{GPU: 8, CPU: 1\} fits on no node: 10.0.0.1 has 4 of 4 GPU left"):
        check_placement([{"CPU": 1, "GPU": 8}], 0, 1, [_node("10.0.0.1", 64, 4)], "PACK")


def test_dead_nodes_do_not_count_and_same_host_nodes_get_distinct_names() -> None:
    nodes = [_node("10.0.0.1", 8, 4, alive=False), _node("127.0.0.1", 8, 2, node_id="aaaaaaaaaa"),
             _node("127.0.0.1", 8, 2, node_id="bbbbbbbbbb")]
    fit = check_placement(_bundles(2, 2, cpu_t=1, cpu_d=1), 2, 2, nodes, "SPREAD")
    assert set(fit.nodes) == {"127.0.0.1", "127.0.0.1/bbbbbbbb"}
    with pytest.raises(PlacementError, match="no live node"):
        check_placement(_bundles(1, 1), 1, 1, [_node("10.0.0.1", 8, 4, alive=False)], "PACK")


def test_unknown_strategy_is_named() -> None:
    with pytest.raises(PlacementError, match=r"topology.strategy='STRICT' is not one of PACK, SPREAD"):
        check_placement(_bundles(1, 1), 1, 1, [_node("10.0.0.1", 8, 4)], "STRICT")


def test_cpu_topology_on_a_cpu_cluster_uses_the_config_bundles() -> None:
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / "conf/tiny.yaml", [])
    plan = plan_bundles(cfg.topology, use_gpu=False)
    fit = check_placement(plan.bundles, plan.num_targets, plan.num_drafters, [_node("127.0.0.1", 2, 0)],
                          cfg.topology.strategy)
    assert len(fit.nodes) == 8  # 5 x 0.2 + 3 x 0.3 CPUs = 1.9 of 2
    with pytest.raises(PlacementError, match=r"target 4 bundle \{CPU: 0.2\} fits on no node: 127.0.0.1 has 0 of 2 CPU left"):
        check_placement(plan.bundles + [{"CPU": 0.3}], plan.num_targets, plan.num_drafters + 1,
                        [_node("127.0.0.1", 2, 0)], "PACK")


def test_the_driver_check_is_a_config_error_naming_the_node() -> None:
    from pathlib import Path

    from app.config.load import ConfigError
    from app.run.placement import check_cluster_fits

    cfg = load_config(Path(__file__).resolve().parents[1] / "conf/tiny.yaml",
                      ["topology.gpus_per_target=1", "topology.gpus_per_drafter=1", "topology.strategy=SPREAD"])
    with pytest.raises(ConfigError, match=r"\(SPREAD\) \(the topology needs 8 GPU, the cluster has 4\).*10.0.0.9 has 0 of 4 GPU"):
        check_cluster_fits(cfg, True, [_node("10.0.0.9", 64, 4)])
