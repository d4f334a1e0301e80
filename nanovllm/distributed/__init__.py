"""The ground floor of running in several processes: the tensor-parallel rank and group size that layers shard by
(`process_group`), and the one supervisor that starts, describes and stops child processes (`supervisor`), for
tensor-parallel workers (`nanovllm.execution.tensor_parallel`) and data-parallel replicas
(`nanovllm.engine.data_parallel`) alike."""
