"""Where vLLM's serve flags were tabled before each setting was declared once; the names stay
importable from here (tokenline/settings/vllm_flags.py has them)."""

from tokenline.settings.vllm_flags import (  # noqa: F401
    VLLM_FLAGS, ServeArgsError, VllmFlag, check_model_argument, check_tokenizer_argument, check_vllm_args,
    no_effect_warning, quiet_request_logs, speculative_config_overrides,
)
