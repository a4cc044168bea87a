import pytest

from asyncfp8.models import check_model_dir, load_model


def test_missing_directory_says_how_to_make_one(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"does not exist; make one with `python -m asyncfp8.models.tiny"
    ):
        load_model(tmp_path / "absent")


def test_file_instead_of_directory(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="is a file"):
        check_model_dir(tmp_path / "model.bin")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        check_model_dir(tmp_path)


def test_broken_config_and_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights"):
        check_model_dir(tmp_path)


def test_a_good_directory_passes(tiny_model_dir):
    assert check_model_dir(str(tiny_model_dir)) == tiny_model_dir
