"""Real media at real sizes (issue 14 item 2, issue 21 item 7): images of every mode and orientation, audio
of every common format and rate, video containers read at another frame rate, from paths and from bytes;
bad files refused naming the file. Every file is made here, with Pillow, soundfile and PyAV."""

from __future__ import annotations

import logging
import struct
import zlib
from fractions import Fraction

import av
import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from zoo.media import (
    MediaError,
    decode_image,
    load_audio,
    load_image,
    load_video,
    save_gif,
    save_mp4,
    save_video,
)
from zoo.media.clips import Frame, played_at
from zoo.media.containers import torchcodec_decoder
from zoo.media.errors import reset_notices

RED, BLUE = (255, 0, 0), (0, 0, 255)


@pytest.fixture(autouse=True)
def fresh_notices():
    """Notices are said once per process; each test starts as a fresh process would."""
    reset_notices()


def levels(pixels: torch.Tensor) -> torch.Tensor:
    """float [-1, 1] back to 0..255 levels."""
    return ((pixels + 1) * 127.5).round()


def red_left_blue_right(height: int, width: int) -> np.ndarray:
    array = np.zeros((height, width, 3), np.uint8)
    array[:, : width // 2], array[:, width // 2 :] = RED, BLUE
    return array


def notices(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage() and r.levelno == logging.WARNING]


# ---------------------------------------------------------------- images


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_exif_orientation_6_reads_upright(tmp_path, fmt):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned a quarter counterclockwise: display turns it clockwise
    path = tmp_path / f"phone.{fmt.lower()}"
    Image.fromarray(red_left_blue_right(20, 40)).save(path, fmt, exif=exif.tobytes(), quality=95)
    image = levels(load_image(path))
    assert image.shape == (3, 40, 20)  # portrait, as shown
    assert image[0, :15].mean() > 240 and image[2, :15].mean() < 15  # the stored left (red) is on top
    assert image[2, 25:].mean() > 240 and image[0, 25:].mean() < 15


def test_malformed_exif_is_said_once_and_the_image_used_as_stored(tmp_path, caplog):
    for name in ("a.png", "b.png"):
        Image.fromarray(red_left_blue_right(20, 40)).save(tmp_path / name, exif=b"Exif\x00\x00XX*\x00junk")
    with caplog.at_level(logging.WARNING, logger="zoo.media"):
        shapes = [load_image(tmp_path / name).shape for name in ("a.png", "b.png")]
    assert shapes == [(3, 20, 40)] * 2
    [notice] = notices(caplog, "malformed EXIF")
    assert "a.png" in notice.getMessage()


def _image(mode: str) -> Image.Image:
    if mode == "P":
        image = Image.new("P", (8, 8), 1)
        image.putpalette([0, 255, 0, 255, 0, 0] + [0] * 762)
        image.paste(0, (0, 0, 8, 4))
        image.info["transparency"] = 0  # palette entry 0 (green) is transparent
        return image
    if mode == "I;16":
        return Image.fromarray(np.full((8, 8), 65535, np.uint16))
    colour = {"1": 1, "L": 255, "LA": (255, 255), "RGBA": (255, 0, 0, 255), "CMYK": (0, 255, 255, 0)}[mode]
    return Image.new(mode, (8, 8), colour)


@pytest.mark.parametrize(
    "mode, fmt, rgb",
    [
        ("1", "PNG", (255, 255, 255)),
        ("L", "PNG", (255, 255, 255)),
        ("LA", "PNG", (255, 255, 255)),
        ("RGBA", "PNG", RED),
        ("I;16", "PNG", (255, 255, 255)),  # full-scale 16-bit is white, not 65535 clamped by chance
        ("CMYK", "JPEG", RED),
        ("P", "PNG", RED),
    ],
)
def test_every_common_mode_becomes_rgb_explicitly(tmp_path, mode, fmt, rgb):
    path = tmp_path / f"image.{fmt.lower()}"
    _image(mode).save(path, fmt)
    assert Image.open(path).mode == mode
    image = levels(load_image(path))
    assert image.shape == (3, 8, 8)
    assert torch.allclose(image[:, -1, -1], torch.tensor(rgb, dtype=torch.float32), atol=3)


def test_16_bit_grey_is_scaled_not_clamped(tmp_path):
    ramp = np.array([[0, 256, 32896, 65535]], np.uint16)  # 0, 1/256, ~1/2 and full scale
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode == "I;16"
    assert levels(load_image(tmp_path / "deep.png"))[0, 0].tolist() == [0, 1, 128, 255]


def test_palette_transparency_is_composited_on_black(tmp_path):
    _image("P").save(tmp_path / "p.png")
    image = levels(load_image(tmp_path / "p.png"))
    assert torch.all(image[:, :4] == 0)  # the transparent green half
    assert torch.all(image[0, 4:] == 255) and torch.all(image[1:, 4:] == 0)


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def test_decompression_bombs_and_images_over_the_cap_are_refused_before_decoding(tmp_path):
    (tmp_path / "bomb.png").write_bytes(_png_header(100_000, 100_000))  # 10^10 pixels in 100 bytes
    with pytest.raises(MediaError, match=r"bomb.png: refused as a decompression bomb"):
        load_image(tmp_path / "bomb.png")
    (tmp_path / "big.png").write_bytes(_png_header(10_000, 10_000))  # under Pillow's refusal, over our cap
    with pytest.raises(MediaError, match=r"big.png: 10000x10000 = 100,000,000 pixels is over the cap"):
        load_image(tmp_path / "big.png")
    Image.fromarray(red_left_blue_right(64, 64)).save(tmp_path / "small.png")
    with pytest.raises(MediaError, match=r"small.png: 64x64 .* over the cap of 1,000 \(max_pixels\)"):
        load_image(tmp_path / "small.png", max_pixels=1000)


def test_bytes_read_like_the_file_and_errors_name_the_sample(tmp_path):
    Image.fromarray(red_left_blue_right(20, 40)).save(tmp_path / "a.png")
    data = (tmp_path / "a.png").read_bytes()
    assert torch.equal(load_image(data, 16), load_image(tmp_path / "a.png", 16))
    with pytest.raises(MediaError, match=r"shard-0001.tar:000042.png: cannot (read|decode) image"):
        load_image(data[: len(data) // 2], name="shard-0001.tar:000042.png")
    with pytest.raises(MediaError, match=r"<7 bytes>: cannot read image"):
        load_image(b"garbage")


def test_a_large_jpeg_is_decoded_at_reduced_scale_and_still_center_cropped(tmp_path):
    Image.fromarray(red_left_blue_right(1024, 2048)).save(tmp_path / "big.jpg", quality=95)
    assert decode_image(tmp_path / "big.jpg").shape == (1024, 2048, 3)
    # center_crop to 64 needs 128x64; the draft keeps twice that: an eighth-scale decode, 256x128.
    assert decode_image(tmp_path / "big.jpg", 64).shape == (128, 256, 3)
    assert decode_image(tmp_path / "big.jpg", 128).shape == (256, 512, 3)  # needs 256x128: quarter scale
    assert decode_image(tmp_path / "big.jpg", 300).shape == (1024, 2048, 3)  # needs 600x300: under 4x, full
    image = levels(load_image(tmp_path / "big.jpg", 64))
    assert image.shape == (3, 64, 64)
    assert image[0, :, :30].mean() > 240 and image[2, :, 34:].mean() > 240  # the centre holds both halves


def test_fit_policies_crop_pad_or_stretch_and_say_so_once(tmp_path, caplog):
    array = np.full((20, 40, 3), 200, np.uint8)
    array[:, :6] = RED  # a left strip, which a centre crop drops
    Image.fromarray(array).save(tmp_path / "wide.png")
    Image.fromarray(array).save(tmp_path / "wide2.png")
    with caplog.at_level(logging.WARNING, logger="zoo.media"):
        crop = levels(load_image(tmp_path / "wide.png", 16))
        load_image(tmp_path / "wide2.png", 16)
        pad = levels(load_image(tmp_path / "wide.png", 16, fit="pad"))
        stretch = levels(load_image(tmp_path / "wide.png", 16, fit="stretch"))
        tall = load_image(tmp_path / "wide.png", (16, 8))
    assert crop.shape == pad.shape == stretch.shape == (3, 16, 16) and tall.shape == (3, 16, 8)
    assert (crop - 200).abs().max() <= 1  # no red left
    assert torch.all(pad[:, :4] == 0) and torch.all(pad[:, 12:] == 0) and pad[0, 4:12, 0].min() > 240
    assert stretch[0, :, 0].min() > 240 and torch.all(stretch[:, :, -1] == 200)
    assert len(notices(caplog, "fit='center_crop'")) == 1 and len(notices(caplog, "fit='pad'")) == 1
    with pytest.raises(ValueError, match="fit must be one of"):
        load_image(tmp_path / "wide.png", 16, fit="squash")


# ---------------------------------------------------------------- audio


def stereo_tone(rate: int, seconds: float = 1.0, hz: float = 1000.0) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    tone = 0.3 * np.sin(2 * np.pi * hz * t)
    return np.stack([tone, 0.5 * tone], axis=1).astype(np.float32)


def peak_hz(wave: torch.Tensor, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave.numpy() * np.hanning(len(wave))))
    return float(np.argmax(spectrum) * rate / len(wave))


@pytest.mark.parametrize(
    "fmt, subtype, rate",
    [
        ("FLAC", "PCM_16", 44100),
        ("OGG", "VORBIS", 44100),
        ("OGG", "OPUS", 48000),
        ("MP3", "MPEG_LAYER_III", 44100),
        ("MP3", "MPEG_LAYER_III", 48000),
        ("WAV", "PCM_16", 48000),
    ],
)
def test_compressed_stereo_at_44k_and_48k_reads_as_16k_mono_with_its_tone(tmp_path, fmt, subtype, rate):
    path = tmp_path / f"tone.{fmt.lower()}"
    sf.write(path, stereo_tone(rate), rate, format=fmt, subtype=subtype)
    for source in (path, path.read_bytes()):
        wave = load_audio(source, 16000)
        assert wave.dtype == torch.float32 and wave.shape == (16000,)  # 1 s
        assert abs(peak_hz(wave, 16000) - 1000) <= 2
        rms = float(wave[1000:-1000].pow(2).mean().sqrt())
        assert rms == pytest.approx(0.3 * 0.75 / np.sqrt(2), rel=0.1)  # the channels' mean


def test_resampling_removes_what_the_new_rate_cannot_hold_instead_of_aliasing_it(tmp_path):
    rate = 44100
    t = np.arange(rate) / rate
    sf.write(tmp_path / "hi.wav", (0.3 * np.sin(2 * np.pi * 10_000 * t)).astype(np.float32), rate, "FLOAT")
    sf.write(tmp_path / "ok.wav", (0.3 * np.sin(2 * np.pi * 7_000 * t)).astype(np.float32), rate, "FLOAT")
    kept = load_audio(tmp_path / "ok.wav", 16000)
    assert abs(peak_hz(kept, 16000) - 7000) <= 2 and float(kept.abs().max()) > 0.28
    # 10 kHz is above the 8 kHz Nyquist limit: a naive resampler folds it to 6 kHz; soxr HQ removes it.
    sf.write(tmp_path / "mix.wav", (0.3 * np.sin(2 * np.pi * 10_000 * t) + 0.01 * np.sin(2 * np.pi * 440 * t))
             .astype(np.float32), rate, "FLOAT")  # fmt: skip
    mixed = load_audio(tmp_path / "mix.wav", 16000)
    spectrum = np.abs(np.fft.rfft(mixed.numpy() * np.hanning(len(mixed))))
    assert spectrum[6000] < 1e-3 * spectrum[440]  # the alias is 60 dB below a tone 30 dB below the input


@pytest.mark.parametrize("fmt, subtype", [("FLAC", "PCM_16"), ("MP3", "MPEG_LAYER_III"), ("OGG", "VORBIS")])
def test_truncated_compressed_audio_is_refused_naming_the_file(tmp_path, fmt, subtype):
    sf.write(tmp_path / "ok", stereo_tone(44100, 2.0), 44100, format=fmt, subtype=subtype)
    data = (tmp_path / "ok").read_bytes()
    (tmp_path / f"cut.{fmt.lower()}").write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaError, match=rf"cut.{fmt.lower()}: .*(truncated|cannot read audio)"):
        load_audio(tmp_path / f"cut.{fmt.lower()}")
    with pytest.raises(MediaError, match=r"sample-7.flac: "):
        load_audio(data[:100], name="sample-7.flac")


# ---------------------------------------------------------------- video

GREYS = [0, 40, 80, 120, 160, 200, 240, 20, 60, 100]  # frame k of the test video is grey GREYS[k]


def grey_video() -> np.ndarray:
    return np.stack([np.full((16, 24, 3), g, np.uint8) for g in GREYS])


def frame_indices(video: torch.Tensor) -> list[int]:
    """Which test-video frame each clip frame is (the nearest grey; lossy codecs move greys by a few)."""
    greys = levels(video[0, :, video.shape[2] // 2, video.shape[3] // 2])
    return [int(np.argmin([abs(g - float(v)) for g in GREYS])) for v in greys]


@pytest.mark.parametrize("suffix", [".mp4", ".webm", ".mkv", ".avi"])
def test_containers_read_back_at_another_fps_pick_frames_by_timestamp(tmp_path, suffix):
    path = save_video(grey_video(), tmp_path / f"v{suffix}", fps=10)
    video = load_video(path)
    assert video.shape == (3, 10, 16, 24) and frame_indices(video) == list(range(10))
    assert (levels(video[0, :, 8, 12]) - torch.tensor(GREYS)).abs().max() <= 6
    assert frame_indices(load_video(path, 4, fps=5)) == [0, 2, 4, 6]
    assert frame_indices(load_video(path, 6, fps=20, start=0.3)) == [3, 3, 4, 4, 5, 5]
    assert frame_indices(load_video(path, 4, fps=10, start="centre")) == [3, 4, 5, 6]
    assert load_video(path, 3, 8).shape == (3, 3, 8, 8)
    assert torch.equal(load_video(path.read_bytes(), 3, name="x"), load_video(path, 3))


def test_mp4_is_h264_or_mpeg4_and_save_mp4_writes_only_mp4(tmp_path):
    path = save_mp4(torch.zeros(3, 2, 8, 8), tmp_path / "a.mp4")
    with av.open(str(path)) as container:
        assert container.streams.video[0].codec_context.name in ("h264", "mpeg4")
    with pytest.raises(ValueError, match="save_mp4 writes .mp4"):
        save_mp4(torch.zeros(3, 2, 8, 8), tmp_path / "a.webm")
    with pytest.raises(ValueError, match="even width and height"):
        save_mp4(torch.zeros(3, 2, 7, 8), tmp_path / "b.mp4")


def test_a_video_shorter_than_the_clip_is_refused_or_its_last_frame_held(tmp_path):
    path = save_video(grey_video(), tmp_path / "v.mp4", fps=10)
    with pytest.raises(MediaError, match=r"v.mp4: video too short: .* 10 frames; expected at least 12"):
        load_video(path, 12)
    assert frame_indices(load_video(path, 12, short="repeat_last")) == [*range(10), 9, 9]
    with pytest.raises(MediaError, match=r"v.mp4: the clip starts at 5 s but the video lasts 1.000 s"):
        load_video(path, 2, start=5.0)


def test_a_long_clip_cut_from_a_longer_video_is_said_once(tmp_path, caplog):
    path = save_video(grey_video(), tmp_path / "v.webm", fps=10)
    with caplog.at_level(logging.WARNING, logger="zoo.media"):
        load_video(path, 2)
        load_video(path, 3)
    [notice] = notices(caplog, "videos longer than the clip are cut")
    assert "v.webm" in notice.getMessage()


@pytest.mark.parametrize("suffix", [".mp4", ".avi"])  # one keyframe; a keyframe every 12 frames
def test_a_clip_deep_into_a_video_starts_at_its_second(tmp_path, suffix):
    ramp = np.stack([np.full((16, 16, 3), 2 * k, np.uint8) for k in range(100)])  # 10 s
    path = save_video(ramp, tmp_path / f"long{suffix}", fps=10)
    clip = levels(load_video(path, 3, start=7.5)[0, :, 8, 8])
    assert (clip - torch.tensor([150.0, 152.0, 154.0])).abs().max() <= 3  # frames 75, 76, 77


def test_the_display_rotation_of_a_phone_video_is_applied(tmp_path):
    path = tmp_path / "portrait.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(10))
        stream.width, stream.height, stream.pix_fmt = 32, 16, "yuv420p"
        stream.set_display_rotation(90)  # shown turned a quarter counterclockwise
        for _ in range(2):
            frame = av.VideoFrame.from_ndarray(red_left_blue_right(16, 32), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    video = levels(load_video(path))
    assert video.shape == (3, 2, 32, 16)
    assert video[2, 0, :12].mean() > 200 and video[0, 0, 20:].mean() > 200  # stored right (blue) on top


def test_truncated_empty_undecodable_and_audio_only_videos_are_refused_naming_the_file(tmp_path):
    for suffix in (".mp4", ".webm"):
        data = save_video(grey_video(), tmp_path / f"ok{suffix}", fps=10).read_bytes()
        (tmp_path / f"cut{suffix}").write_bytes(data[: len(data) * 3 // 5])
        with pytest.raises(MediaError, match=rf"cut{suffix}: .*(cannot read video|truncated|no frames)"):
            load_video(tmp_path / f"cut{suffix}")
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "junk.mkv").write_bytes(b"\x1aE\xdf\xa3 not really matroska" * 20)
    sf.write(tmp_path / "speech.wav", stereo_tone(16000), 16000)
    cases = {"empty.mp4": "cannot read video", "junk.mkv": "cannot read video|no video stream|no frames",
             "speech.wav": "no video stream"}  # fmt: skip
    for name, reason in cases.items():
        with pytest.raises(MediaError, match=rf"{name}: .*({reason})"):
            load_video(tmp_path / name)
    with pytest.raises(MediaError, match=r"sample-3.mp4: "):
        load_video(data[:500], name="sample-3.mp4")
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        load_video(tmp_path / "missing.mp4")


def test_gifs_are_read_at_another_fps_by_their_frame_durations(tmp_path):
    video = torch.from_numpy(grey_video()[:4]).permute(3, 0, 1, 2).float() / 127.5 - 1
    zoo_gif = save_gif(video, tmp_path / "zoo.gif", fps=4)
    assert frame_indices(load_video(zoo_gif, fps=8)) == [0, 0, 1, 1, 2, 2, 3, 3]
    frames = [Image.fromarray(a) for a in grey_video()[:4]]
    frames[0].save(
        tmp_path / "plain.gif", save_all=True, append_images=frames[1:], duration=[100, 300, 100, 100]
    )
    # A plain GIF plays at its median frame duration (100 ms): frame 1 is shown for three clip frames.
    assert frame_indices(load_video(tmp_path / "plain.gif")) == [0, 1, 1, 1, 2, 3]
    # 0.6 s long, a 0.4 s clip in the middle: from 0.1 s.
    assert frame_indices(load_video((tmp_path / "plain.gif").read_bytes(), 4, start="centre")) == [1, 1, 1, 2]


def test_a_folder_of_jpeg_frames_is_one_file_per_frame_and_says_it_has_no_timing(tmp_path, caplog):
    for k, grey in enumerate(GREYS[:5]):
        Image.fromarray(np.full((16, 16, 3), grey, np.uint8)).save(tmp_path / f"f{k}.jpg", quality=95)
    with caplog.at_level(logging.WARNING, logger="zoo.media"):
        clip = load_video(tmp_path, 3, 8, fps=30, start="centre")
    assert clip.shape == (3, 3, 8, 8) and frame_indices(clip) == [1, 2, 3]
    assert len(notices(caplog, "a folder of frames has no timestamps")) == 1


def test_frames_are_the_ones_on_screen_despite_rounded_timestamps():
    # 30 fps in a 1/12800 time base: frame k at round(k * 12800 / 30) ticks, never exactly k / 30 s.
    source = [Frame(round(k * 12800 / 30) / 12800, 1 / 30, k) for k in range(30)]
    same, more = played_at(iter(source), (k / 30 for k in range(30)), 1 / 30)
    assert same == list(range(30)) and not more
    third, more = played_at(iter(source), (k / 10 for k in range(5)), 1 / 30)
    assert third == [0, 3, 6, 9, 12] and more


def test_torchcodec_is_used_only_when_it_loads(tmp_path):
    path = save_video(grey_video(), tmp_path / "v.mp4", fps=10)
    if torchcodec_decoder() is None:
        with pytest.raises(MediaError, match="torchcodec is not installed or loadable"):
            load_video(path, 2, backend="torchcodec")
        assert load_video(path, 2, backend="auto").shape == (3, 2, 16, 24)  # PyAV
    else:
        clip = load_video(path, 4, fps=5, backend="torchcodec")
        assert frame_indices(clip) == frame_indices(load_video(path, 4, fps=5, backend="pyav"))
