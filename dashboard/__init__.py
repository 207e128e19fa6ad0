"""The Streamlit dashboard (`infersim dashboard`): What-if, Compare, Search and Validation pages over the
application API (infersim.api)."""
