"""AppConfig: dotted CLI keys and nested YAML mappings, and errors that name the key."""

from __future__ import annotations

import re

import pytest

from rayinfer.app import build, phase_options, replica_runtime_env
from rayinfer.config import ConfigError
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.config_args import nest_dotted_keys
from rayinfer.exchange_config import AllToAllConfig, HostStagedConfig


def test_dotted_cli_strings_become_typed_nested_fields():
    config = AppConfig.from_args(
        {
            "model": "tiny",
            "decode.autoscaling.max_replicas": "2",
            "decode.autoscaling.upscale_delay_s": "1.5",
            "prefill.max_num_batched_tokens": "512",
            "enable_prefix_caching": "false",
        }
    )
    assert config.decode.autoscaling.max_replicas == 2
    assert config.decode.autoscaling.upscale_delay_s == 1.5
    assert config.prefill.max_num_batched_tokens == 512
    assert config.prefill.autoscaling.max_replicas == 1  # phases autoscale independently
    assert config.enable_prefix_caching is False


def test_yaml_mappings_and_dotted_keys_merge():
    nested = nest_dotted_keys(
        {"decode": {"autoscaling": {"min_replicas": 1}}, "decode.autoscaling.max_replicas": 3}
    )
    assert nested == {"decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 3}}}
    assert AppConfig.from_args(nested).decode.autoscaling.max_replicas == 3


def test_defaults_are_one_replica_per_phase():
    config = AppConfig.from_args({})
    for phase in (config.prefill, config.decode):
        assert (phase.autoscaling.min_replicas, phase.autoscaling.max_replicas) == (1, 1)


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"decode.autoscaling.max_replica": "2"}, "decode.autoscaling.max_replica: unknown key"),
        ({"prefil.tp": "1"}, "prefil: unknown key; allowed here: model"),
        ({"dtype": "fp8"}, "dtype='fp8'"),
        ({"max_model_len": "abc"}, "max_model_len='abc'"),
        ({"decode.autoscaling.min_replicas": "3"}, "min_replicas=3 exceeds max_replicas=1"),
        ({"prefill.ep": "2"}, "prefill.ep=2 must divide"),
        ({"decode": "1", "decode.tp": "1"}, "decode is set to '1' and also used as a section"),
        ({"decode.all_to_all.transport": "nvlink"}, "decode.all_to_all.transport='nvlink'"),
        ({"prefill.all_to_all.dedupe": "true"}, "prefill.all_to_all.dedupe: unknown key"),
        ({"index_cache_dtype": "fp8"}, "index_cache_dtype='fp8'"),
        ({"ingress.max_queue_wait_s": "0"}, "ingress.max_queue_wait_s='0': Input should be"),
        (
            {"reasoning_parser": "deepseek"},
            "reasoning_parser='deepseek': Input should be 'deepseek_r1', 'deepseek_v3', "
            "'qwen3' or 'glm45'",
        ),
        ({"reasoning_parser": "none"}, "reasoning_parser='none': Input should be 'deepseek_r1'"),
        ({"reasoning_parser": True}, "reasoning_parser=True: Input should be 'deepseek_r1'"),
    ],
)
def test_invalid_args_name_the_key(args, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        AppConfig.from_args(args)


def test_reasoning_parser_is_off_unless_named():
    assert AppConfig.from_args({}).reasoning_parser is None
    assert AppConfig.from_args({"reasoning_parser": None}).reasoning_parser is None  # YAML null
    assert AppConfig.from_args({"reasoning_parser": "qwen3"}).reasoning_parser == "qwen3"


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError) as error:
        AppConfig.from_args({"decode.autoscaling.max_replica": "2"})
    assert "max_replicas" in str(error.value) and "target_ongoing_requests" in str(error.value)


def test_build_fails_before_touching_ray_on_a_bad_key():
    with pytest.raises(ConfigError, match="decode.autoscaling.max_replica"):
        build({"decode.autoscaling.max_replica": 2})


def test_fp8_index_keys_are_for_dsa_models_and_refused_at_build_for_others():
    assert AppConfig.from_args({"index_cache_dtype": "fp8_e4m3"}).index_cache_dtype == "fp8_e4m3"
    assert AppConfig.from_args({}).index_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="index_cache_dtype='fp8_e4m3' is for DeepSeek Sparse"):
        build({"model": "tiny", "index_cache_dtype": "fp8_e4m3"})  # DeepSeek-V3-style: no DSA


def test_phase_options_reserve_whole_worker_groups():
    config = AppConfig.from_args({"decode.autoscaling.max_replicas": "2"})
    cpu = phase_options(config, config.decode, use_gpus=False)
    assert cpu["placement_group_strategy"] == "STRICT_PACK"
    assert cpu["placement_group_bundles"] == [{"CPU": 0.1}, {"CPU": 0.5}]
    assert cpu["autoscaling_config"]["max_replicas"] == 2
    config = AppConfig.from_args({"prefill.tp": "2", "prefill.ep": "2"})
    gpu = phase_options(config, config.prefill, use_gpus=True)
    assert gpu["placement_group_bundles"][1:] == [{"GPU": 1.0, "CPU": 1.0}] * 2


def test_handlers_on_replica_loop_sets_serves_switches_in_the_replicas(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # no declared variable set: Serve's switches alone
    config = AppConfig.from_args({})
    env = phase_options(config, config.engine, use_gpus=False)["ray_actor_options"]
    assert env["runtime_env"]["env_vars"] == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
    assert env["num_cpus"] > 0
    ingress = replica_runtime_env(config, is_ingress=True)["runtime_env"]["env_vars"]
    assert ingress["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    config = AppConfig.from_args({"handlers_on_replica_loop": "false"})
    assert "runtime_env" not in phase_options(config, config.engine, False)["ray_actor_options"]


def test_declared_environment_variables_reach_the_replicas(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYINFER_CACHE", str(tmp_path))
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    config = AppConfig.from_args({"handlers_on_replica_loop": "false"})
    env_vars = replica_runtime_env(config)["runtime_env"]["env_vars"]
    assert env_vars["RAYINFER_CACHE"] == str(tmp_path) and "NCCL_P2P_DISABLE" not in env_vars


def test_example_serve_config_is_valid():
    import yaml

    from rayinfer.bench.serve_cluster import REPO_ROOT

    config = yaml.safe_load((REPO_ROOT / "examples" / "serve_config.yaml").read_text())
    [app] = config["applications"]
    assert app["import_path"] == "rayinfer.app:build"
    parsed = AppConfig.from_args(app["args"])
    assert parsed.decode.autoscaling.max_replicas == 2


def test_grafana_dashboard_charts_every_serve_metric():
    import json

    from rayinfer.bench.serve_cluster import REPO_ROOT
    from rayinfer.deployments.metrics import METRIC_NAMES

    path = REPO_ROOT / "rayinfer" / "deployments" / "grafana_dashboard.json"
    exprs = " ".join(
        target["expr"]
        for panel in json.loads(path.read_text())["panels"]
        for target in panel["targets"]
    )
    missing = [name for name in METRIC_NAMES if f"ray_{name}" not in exprs]
    assert not missing, f"metrics without a dashboard panel: {missing}"


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "abc"])
def test_gpu_memory_utilization_outside_zero_to_one_names_the_key_and_range(value):
    with pytest.raises(ConfigError) as error:
        AppConfig.from_args({"decode.gpu_memory_utilization": value})
    assert "decode.gpu_memory_utilization" in str(error.value)
    if value != "abc":
        assert "(0, 1]" in str(error.value)


def test_gpu_memory_utilization_is_per_phase_and_defaults_on_gpus_only():
    config = AppConfig.from_args({"prefill.gpu_memory_utilization": "0.85"})
    assert config.prefill.gpu_memory_utilization == 0.85
    assert config.decode.gpu_memory_utilization is None  # default: 0.9 on GPUs (runtime.py)


def test_gpu_memory_utilization_with_a_shared_gpu_is_a_fraction_of_the_share():
    config = AppConfig.from_args(
        {"decode.gpu_memory_utilization": "0.9", "decode.gpus_per_worker": "0.5"}
    )
    assert (config.decode.gpu_memory_utilization, config.decode.gpus_per_worker) == (0.9, 0.5)


@pytest.mark.parametrize(
    "value, parsed", [("true", True), ("off", False), ("AUTO", "auto"), (False, False)]
)
def test_disaggregate_takes_true_false_or_auto(value, parsed):
    assert AppConfig.from_args({"disaggregate": value}).disaggregate == parsed
    assert AppConfig.from_args({}).disaggregate == "auto"


def test_the_colocated_engine_defaults_to_mixed_batches_with_every_kind_of_graph():
    from rayinfer.deployments.runtime import phase_graphs
    from rayinfer.graph_config import CudaGraphConfig

    engine = AppConfig.from_args({}).engine
    assert (engine.max_num_seqs, engine.max_num_batched_tokens) == (128, 8192)
    assert engine.max_ongoing_requests == 128
    graphs = phase_graphs(engine, "engine", use_gpus=True, max_model_len=8192)
    assert graphs == CudaGraphConfig(
        max_batch_size=128, max_model_len=8192, max_prefill_tokens=8192, max_piecewise_tokens=4096
    )
    assert phase_graphs(engine, "engine", use_gpus=False, max_model_len=4096) is None


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"disaggregate": "false", "engine.ep": "2"}, "engine.ep=2 must divide"),
        ({"engine.ep": "2"}, "engine.ep=2 must divide"),  # auto may serve with it
        ({"disaggregate": "maybe"}, "disaggregate='maybe': use true, false or auto"),
        ({"engine.max_num_seq": "4"}, "engine.max_num_seq: unknown key"),
        ({"load_format": "pt"}, "load_format='pt'"),
        ({"engine.waiting_served_ratio": "-1"}, "engine.waiting_served_ratio='-1'"),
        ({"engine.max_waiting_steps": "0"}, "engine.max_waiting_steps='0'"),
        (
            {"disaggregate": "false", "engine.cuda_graphs": "true", "engine.dp": "2",
             "engine.ep": "2", "engine.all_to_all.dedup": "true"},
            "engine.cuda_graphs=true cannot capture this forward: engine.all_to_all.dedup=true",
        ),
    ],
)  # fmt: skip
def test_engine_section_errors_name_its_keys(args, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        AppConfig.from_args(args)


def test_sections_a_mode_does_not_serve_are_not_checked():
    config = AppConfig.from_args({"disaggregate": "true", "engine.ep": "2"})
    assert config.engine.ep == 2  # never started: Prefill and Decode serve
    assert AppConfig.from_args({"disaggregate": "false", "prefill.ep": "2"}).prefill.ep == 2


def test_build_checks_the_served_sections_against_the_model():
    with pytest.raises(ConfigError, match=r"engine\.tp=3 does not divide num_attention_heads"):
        build({"disaggregate": "false", "engine.tp": "3"})
    with pytest.raises(ConfigError, match=r"decode\.tp=3 does not divide num_attention_heads"):
        build({"engine.tp": "3", "decode.tp": "3"})  # auto on the CPU: disaggregated
    with pytest.raises(ConfigError, match=r"engine\.fp8_weights"):
        build({"disaggregate": "false", "engine.fp8_weights": "true"})  # tiny has no FP8


def test_each_phase_chooses_its_token_exchange():
    """GPUs without peer-to-peer: decode's experts exchange through host memory, FP8 dispatch;
    the options are the AllToAllConfig that LLM(all_to_all=...) makes and the workers take."""
    config = AppConfig.from_args(
        {
            "decode.all_to_all.transport": "host",
            "decode.all_to_all.use_fp8": "true",
            "decode.all_to_all.host.direct_max_bytes": "4096",
            "prefill.all_to_all.dedup": "false",
            "prefill.all_to_all.local_first": "true",
        }  # fmt: skip
    )
    host = HostStagedConfig(direct_max_bytes=4096)
    assert config.decode.all_to_all == AllToAllConfig(transport="host", use_fp8=True, host=host)
    assert config.prefill.all_to_all.dedup is False and config.prefill.all_to_all.local_first
    assert config.prefill.all_to_all.transport == "auto"


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"decode.all_to_all.host.protocol": "nvlink"},
         "decode.all_to_all.host.protocol='nvlink': Input should be 'auto', 'gpu' or 'cpu'"),
        ({"decode.all_to_all.host.direct_max_bytes": "-1"},
         "decode.all_to_all.host.direct_max_bytes=-1 must be an integer >= 0"),
        ({"decode.all_to_all.host.chunk_size": "1"},
         "decode.all_to_all.host.chunk_size: unknown key; allowed here: protocol, "
         "direct_max_bytes, chunk_overhead_bytes"),
        ({"decode.overlap.first_share": "1.5"},
         "decode.overlap.first_share=1.5; use a fraction between 0 and 1"),
        ({"prefill.overlap.shared_experts": "later"},
         "prefill.overlap.shared_experts='later': Input should be 'dispatch', "
         "'second-at-combine' or 'combine'"),
        ({"engine.kernels.fp8_gemm": "cutlass"},
         "engine.kernels.fp8_gemm='cutlass': Input should be 'auto', 'triton' or 'cublas'"),
        ({"decode.process.numa": "0"},
         "decode.process.numa: unknown key; allowed here: numa_bind, gc_freeze, profile_cpu, "
         "gil_switch_interval_ms"),
        ({"decode.process.profile_cpu": "1"},
         "decode.process.profile_cpu='1': Input should be 'ops', 'none', 'stack' or 'python'"),
    ],
)  # fmt: skip
def test_typed_sections_name_the_bad_key_and_the_valid_values(args, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        AppConfig.from_args(args)


def test_typed_sections_reach_the_engine_args_as_given():
    from rayinfer.deployments.runtime import ModelSource, phase_engine_args

    config = AppConfig.from_args(
        {"decode.overlap.first_share": "0.4", "decode.kernels.small_batch_moe": "true",
         "decode.process.gc_freeze": "false", "decode.all_to_all.host.protocol": "cpu",
         "decode.process.gil_switch_interval_ms": "0.5"}
    )  # fmt: skip
    args = phase_engine_args(config, ModelSource.resolve(config), "decode", use_gpus=False)
    assert args.overlap is config.decode.overlap and args.overlap.first_share == 0.4
    assert args.kernels.small_batch_moe and not args.process.gc_freeze
    assert args.process.gil_switch_interval_ms == 0.5
    assert args.all_to_all is config.decode.all_to_all and args.all_to_all.host.protocol == "cpu"
    assert args.key_prefix == "decode."


def test_held_prompts_reach_the_engines_scheduler():
    from rayinfer.deployments.runtime import ModelSource, phase_engine_args

    config = AppConfig.from_args(
        {"engine.waiting_served_ratio": "0.5", "engine.max_waiting_steps": "8"}
    )
    args = phase_engine_args(config, ModelSource.resolve(config), "engine", use_gpus=False)
    scheduler = args.scheduler_config(max_model_len=256)
    assert (scheduler.waiting_served_ratio, scheduler.max_waiting_steps) == (0.5, 8)
    assert AppConfig.from_args({}).engine.waiting_served_ratio == 0.0  # admitted at once
