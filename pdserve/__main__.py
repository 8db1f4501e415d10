"""`python -m pdserve`"""

from pdserve.cli.main import app

app(prog_name="pdserve")
