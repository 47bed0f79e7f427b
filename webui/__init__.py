"""The web app's tabs, one module each, over ``common`` (store, jobs, one error decorator, widget
coercion) and ``linking`` (the current setup across tabs). Only ``app.py`` and ``webui/`` import gradio."""
