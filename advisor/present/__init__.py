"""Present: text, tables and charts of estimates, plans and runs for the CLI, the app and the report; no gradio."""
