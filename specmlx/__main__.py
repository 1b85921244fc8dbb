from .cli import run_app

run_app()
