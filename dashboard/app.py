"""`infersim dashboard`: the Streamlit app, its four pages. Run it with `infersim dashboard [--port N]`."""
from pathlib import Path

import streamlit as st

HERE = Path(__file__).parent
PAGES = [("What-if", "whatif_page.py", "whatif"), ("Compare", "compare_page.py", "compare"),
         ("Search", "search_page.py", "search"), ("Validation", "validation_page.py", "validation")]

st.set_page_config(page_title="infersim", layout="wide")
# Streamlit serves the default page at "/" only, so its own name gets a hidden page that goes there.
pages = [st.Page(str(HERE / file), title=title, url_path=url + "_page" if url == "whatif" else url,
                 default=url == "whatif") for title, file, url in PAGES]
alias = st.Page(lambda: st.switch_page(pages[0]), title="What-if", url_path="whatif", visibility="hidden")
st.navigation([*pages, alias]).run()
