"""The learner stage: samples in, a continuously trained DeepFM out (checkpoints and serving deltas).

Owns: its settings, the model config and the choices among them (``config.py``), the feature config
(``features.py``), Arrow batches -> tensors (``batch.py``), the model from small parts (``model.py``), the sparse
optimizers (``optim.py``) and their update fused into the lookup's backward (``fused_update.py``), the health
monitors (``health.py``: memory, gradient and update norms, coverage), dynamic ids and cold start (``id_map.py``,
``row_mapper.py``, ``cold_start.py``), test-then-train and progressive metrics (``trainer.py``,
``progressive.py``), delayed feedback's weights and base-rate bias (``delayed.py``), served quality
(``served.py``), the served logit's online calibration (``calibration.py``), the Kafka dataset
(``kafka_dataset.py``), checkpoints and deltas (``checkpoint.py``, ``deltas.py``, ``tensorpack.py``), the serving
artifact's format, build and readers (``artifact.py``) with its scorer module (``scorer.py``), the scorer's files
in each format (``scorer_files.py``; the ONNX Runtime scorer in ``onnx_scorer.py``), the daemon (``daemon.py``) and
the offline and online evaluation (``evaluation/``).

May import: ``stream/`` and third-party libraries; never ``cache_refresh/``, ``serving/`` or
``monitor/``. Entry points: ``learner.daemon.Learner`` (``streamrec train``),
``learner.evaluation.protocols.evaluate`` (``streamrec evaluate``).
"""
