"""The streaming runtime: Flink's job model on Spark's scheduler (``docs/streaming.md``).

::

    from client.streaming import StreamEnvironment, RunningReduce

    env = StreamEnvironment(spark, checkpoint_dir="/tmp/ckpt")
    (env.from_generator(lambda i: (i % 10, i), count=1000)
        .key_by(lambda e: e[0])
        .process(RunningReduce(lambda a, b: (a[0], a[1] + b[1])))
        .collect(name="totals"))
    result = env.execute()            # or env.execute(runner="local"): no JVM
    result.collected["totals"]
"""

from __future__ import annotations

from client.streaming.checkpoint_storage import CheckpointMetadata, CheckpointStorage
from client.streaming.connectors import (
    CollectSink,
    ConnectorError,
    FileSink,
    FileSource,
    GeneratorSource,
    PrintSink,
    SinkCommitError,
    SourceFormatError,
    SourceNotFoundError,
)
from client.streaming.environment import (
    CheckpointInfo,
    DataStream,
    JobFailedError,
    JobResult,
    KeyedStream,
    StreamEnvironment,
)
from client.streaming.functions import Collector, Operator, OperatorContext, Source
from client.streaming.operators import (
    KeyedProcessFunction,
    ProcessContext,
    RunningReduce,
    RuntimeContext,
)
from client.streaming.runners import LocalRunner, TaskProcessError

__all__ = [
    "CheckpointInfo",
    "CheckpointMetadata",
    "CheckpointStorage",
    "CollectSink",
    "Collector",
    "ConnectorError",
    "DataStream",
    "FileSink",
    "FileSource",
    "GeneratorSource",
    "JobFailedError",
    "JobResult",
    "KeyedProcessFunction",
    "KeyedStream",
    "LocalRunner",
    "Operator",
    "OperatorContext",
    "PrintSink",
    "ProcessContext",
    "RunningReduce",
    "RuntimeContext",
    "SinkCommitError",
    "Source",
    "SourceFormatError",
    "SourceNotFoundError",
    "StreamEnvironment",
    "TaskProcessError",
]
