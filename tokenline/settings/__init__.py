"""Every setting declared once: a dataclass field with its flag, help, default, group and vLLM name
(``declare.setting``), from which the command-line parsers, the settings objects, ``--config`` files
and the configuration reference are made. Torch-free: the API process imports it."""
