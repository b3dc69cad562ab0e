"""Where models live on disk (``tokenline_home()``) and how a ``--model`` argument becomes a local
HF-format directory, importing a GGUF file once. ``model_store`` is torch-free (the API process and
the gateway read it); ``gguf_import`` converts weights with torch and is imported only to import one."""
