"""`serve --http`: Prometheus metrics and a read-only web view of the history.

app.py is the Starlette app (routes, authentication), views.py what each page
shows (from the registry's read methods), templates/ the pages, server.py
uvicorn on a thread of its own.
"""
