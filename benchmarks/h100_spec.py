# ruff: noqa: E501 (the spec's lines, as XLA writes them)
"""XLA's description of an NVIDIA H100 SXM, for compiling without one.

openxla/xla `xla/backends/gpu/target_config/specs/h100_sxm.txtpb` (Apache-2.0), less
`collective_memory_granularity`, which jaxlib 0.10.2's `GpuDeviceInfoProto` does not
know. `jax.experimental.topologies.get_topology_desc(platform="cuda",
topology="1x1x1", target_config=H100_SXM)` then gives a compile-only device.
"""

# fmt: off
H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  scalar_unit_description {
    rate_infos { key: 4 value { clock_rate_ghz: 1.98 units_per_core: 64 ops_per_clock: 1 } }
    rate_infos { key: 8 value { clock_rate_ghz: 1.98 units_per_core: 64 ops_per_clock: 1 } }
    rate_infos { key: 10 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 2 } }
    rate_infos { key: 11 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 1 } }
    rate_infos { key: 12 value { clock_rate_ghz: 1.98 units_per_core: 64 ops_per_clock: 1 } }
    rate_infos { key: 16 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 2 } }
  }
  matrix_unit_description {
    rate_infos { key: 2 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 6 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 10 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 512 } }
    rate_infos { key: 11 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 256 } }
    rate_infos { key: 12 value { clock_rate_ghz: 1.98 units_per_core: 4 ops_per_clock: 32 } }
    rate_infos { key: 16 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 512 } }
    rate_infos { key: 19 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 20 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 23 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 24 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 25 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 28 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 29 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 33 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 35 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 36 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
  }
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  model_str: "sm_9.0a with 84942979072B RAM, 132 cores, 1980000KHz clock, 2619000KHz mem clock, 52428800B L2$"
  device_address_bits: 64
  pcie_bandwidth: 34359738368
  ecc_enabled: true
  name: "NVIDIA H100 80GB HBM3"
  driver_version: "13.0.0"
  runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0"
  dnn_version: "9.10.0"
  cub_version: "3.1.2"
  device_interconnect_info { active_links: 18 }
}
platform_name: "CUDA"
dnn_version_info { major: 8 minor: 9 patch: 4 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
# fmt: on
