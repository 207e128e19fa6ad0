"""`infersim dashboard`: the Streamlit app, its four pages. Run it with `infersim dashboard [--port N]`."""
from pathlib import Path

import streamlit as st

HERE = Path(__file__).parent
PAGES = [("What-if", "whatif_page.py", "whatif"), ("Compare", "compare_page.py", "compare"),
         ("Search", "search_page.py", "search"), ("Validation", "validation_page.py", "validation")]

st.set_page_config(page_title="infersim", layout="wide")
pages = [st.Page(str(HERE / file), title=title, url_path=url, default=url == "whatif") for title, file, url in PAGES]
st.navigation(pages).run()
